"""Where benchmark results go: ``bench/results/<kind>-<UTC timestamp>.json``."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def save_result(kind: str, record: dict[str, Any]) -> Path:
    """Write one run's figures (with a ``when`` stamp) and return the file's path."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{kind}-{stamp}.json"
    path.write_text(json.dumps({"when": stamp, **record}, indent=2))
    return path
