"""What the text-scenario tests share: a script's "=>" lines are what the code prints for it.

A scenario file holds commands and, after each, the "=>" lines the runner printed when the file was
last reviewed. The runner reruns every command and reprints every line; a file whose text changes
fails. ``FS3_REWRITE=1`` writes the new text back instead, for a reviewed diff.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def check_scenario_file(path: Path, run_script: Callable[[str], str]) -> None:
    """Fail unless ``run_script`` reproduces ``path`` exactly (rewrite it under ``FS3_REWRITE``)."""
    text = path.read_text()
    actual = run_script(text)
    if os.environ.get("FS3_REWRITE"):
        path.write_text(actual)
    assert actual == text, f"{path.name} changed; rerun with FS3_REWRITE=1 and review the diff"
