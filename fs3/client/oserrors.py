"""fs3 errors as the ``OSError`` a local file system would raise (same errno, same subclass)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from fs3.common.errors import FS3Error

__all__ = ["os_errors"]


@contextlib.contextmanager
def os_errors(path: object = None, path2: object = None) -> Iterator[None]:
    try:
        yield
    except FS3Error as exc:
        shown = os.fsdecode(path) if isinstance(path, str | bytes | os.PathLike) else path
        if path2 is not None:
            other = os.fsdecode(path2) if isinstance(path2, str | bytes | os.PathLike) else path2
            raise OSError(exc.errno, exc.message, shown, None, other) from None
        raise exc.to_os_error(shown) from None
