"""Directories that survive a power loss.

A new directory is durable only once the directory holding it has been fsynced: until then a
power loss may take it back, with every file in it, however carefully those files were synced.
:func:`make_dirs_durable` creates what is missing of a path and syncs each new entry's parent.
"""

from __future__ import annotations

import os
from pathlib import Path

from fs3.common.errors import IoError

__all__ = ["make_dirs_durable", "sync_dir"]


def sync_dir(path: str | Path) -> None:
    """fsync a directory: the entries created, renamed or removed in it become durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs_durable(path: str | Path) -> None:
    """``mkdir -p path``, each directory it creates synced into its parent (raises IoError). New
    directories are ``0700``: they hold a service's data, for no other local user."""
    target = Path(path).absolute()
    missing: list[Path] = []
    cursor = target
    while not cursor.exists():
        missing.append(cursor)
        if cursor.parent == cursor:
            break
        cursor = cursor.parent
    try:
        for directory in reversed(missing):
            directory.mkdir(mode=0o700, exist_ok=True)
            sync_dir(directory.parent)
    except OSError as exc:
        raise IoError(f"creating {target}: {exc.strerror or exc}") from None
    if not target.is_dir():
        raise IoError(f"{target} is not a directory")
