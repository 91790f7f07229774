"""Logging setup shared by every fs3 process: one line per event, service name first."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["setup_logging"]


def setup_logging(service: str, level: str | None = None) -> None:
    """Configure the root logger for a service process (``FS3_LOG_LEVEL`` overrides ``level``)."""
    chosen = (os.environ.get("FS3_LOG_LEVEL") or level or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname).1s {service}[%(process)d] %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(chosen)

