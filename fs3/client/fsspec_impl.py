"""fs3 as an fsspec file system: ``fsspec.filesystem("fs3", mgmtd="HOST:PORT", token=...)``.

Registered under the ``fs3`` protocol through the ``fsspec.specs`` entry point, so URLs like
``fs3://HOST:PORT/datasets/train.parquet`` work in pandas, pyarrow, ``torch.distributed.checkpoint``
and anything else that takes fsspec URLs. What a URL leaves out comes from a profile or the
environment (:mod:`fs3.client.profiles`): ``fs3://NAME@/path`` uses profile NAME, ``fs3:///path``
``$FS3_MGMTD``/``$FS3_TOKEN`` or the ``default`` profile — which is how code that rebuilds the file
system from the URL alone (torch's checkpointer) finds the token.
"""

from __future__ import annotations

import datetime
import os
import stat as stat_mod
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.utils import infer_storage_options

from fs3.client.sync_api import FileSystem, connect

__all__ = ["FS3FileSystem"]

_COPY_PIECE_BYTES = 8 * 1024 * 1024


class FS3FileSystem(AbstractFileSystem):  # type: ignore[misc]
    protocol = "fs3"
    root_marker = "/"

    def __init__(self, mgmtd: str | None = None, token: str | None = None, auto_mkdir: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(mgmtd=mgmtd, token=token, auto_mkdir=auto_mkdir, **kwargs)
        # Like object stores (and fsspec's local file system with auto_mkdir): writing a file
        # creates its parent directories, which is what pandas, pyarrow and checkpointers expect.
        self.auto_mkdir = auto_mkdir
        options = {k: v for k, v in kwargs.items() if k not in ("skip_instance_cache", "use_listings_cache",
                                                                "listings_expiry_time", "max_paths")}
        self.client: FileSystem = connect(mgmtd, token, **options)  # profile=, token_file= among the options

    # -- paths -----------------------------------------------------------------------------------

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith("fs3://"):
            rest = path[len("fs3://"):]
            path = "/" + rest.split("/", 1)[1] if "/" in rest else "/"
        path = path.rstrip("/") or "/"
        return path if path.startswith("/") else "/" + path

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        options = infer_storage_options(path)
        host, port, profile = options.get("host"), options.get("port"), options.get("username")
        found: dict[str, Any] = {"mgmtd": f"{host}:{port}"} if host and port else {}
        if profile:
            found["profile"] = profile  # fs3://NAME@/path
        return found

    def unstrip_protocol(self, name: str) -> str:
        profile = self.storage_options.get("profile")
        return f"fs3://{profile + '@' if profile else ''}{self.storage_options.get('mgmtd') or ''}{name}"

    # -- listing ---------------------------------------------------------------------------------

    def _info_from(self, path: str, st: os.stat_result, link_target: str | None = None) -> dict[str, Any]:
        if stat_mod.S_ISDIR(st.st_mode):
            kind = "directory"
        elif stat_mod.S_ISREG(st.st_mode):
            kind = "file"
        else:
            kind = "other"
        info = {"name": path, "size": st.st_size if kind == "file" else 0, "type": kind,
                "mode": st.st_mode, "ino": st.st_ino, "nlink": st.st_nlink, "uid": st.st_uid, "gid": st.st_gid,
                "mtime": st.st_mtime, "created": st.st_ctime, "islink": stat_mod.S_ISLNK(st.st_mode)}
        if link_target is not None:
            info["destination"] = link_target
        return info

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        lst = self.client.lstat(path)
        if stat_mod.S_ISLNK(lst.st_mode):
            target = self.client.readlink(path)
            try:
                return self._info_from(path, self.client.stat(path), target)
            except FileNotFoundError:
                return self._info_from(path, lst, target)
        return self._info_from(path, lst)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        st = self.client.stat(path)
        if not stat_mod.S_ISDIR(st.st_mode):
            info = self._info_from(path, st)
            return [info] if detail else [path]
        base = path.rstrip("/")
        entries = [self._info_from(f"{base}/{e.name}", e.stat()) for e in self.client.scandir(path)]
        return entries if detail else [e["name"] for e in entries]

    # -- changes ---------------------------------------------------------------------------------

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if create_parents:
            self.client.makedirs(path, exist_ok=False)
        else:
            self.client.mkdir(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.client.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def rmdir(self, path: str) -> None:
        self.client.rmdir(self._strip_protocol(path))

    def rm_file(self, path: str) -> None:
        self.client.remove(self._strip_protocol(path))

    def _rm(self, path: str) -> None:
        path = self._strip_protocol(path)
        if self.client.isdir(path):
            self.client.rmdir(path)
        else:
            self.client.remove(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        for p in sorted(paths, key=len, reverse=True):  # children before their directories
            self._rm(p)

    def mv(self, path1: Any, path2: Any, recursive: bool = False, maxdepth: int | None = None,
           **kwargs: Any) -> None:
        if isinstance(path1, str) and isinstance(path2, str) and not any(c in path1 for c in "*?["):
            src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
            if self.client.isdir(dst) and not self.client.isdir(src):
                dst = f"{dst.rstrip('/')}/{src.rsplit('/', 1)[-1]}"
            self.client.rename(src, dst)  # atomic, whatever the size
            return
        super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)

    def _make_parent(self, path: str) -> None:
        parent = path.rsplit("/", 1)[0]
        if self.auto_mkdir and parent:
            self.client.makedirs(parent, exist_ok=True)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        if self.client.isdir(src):
            self.client.makedirs(dst, exist_ok=True)
            return
        self._make_parent(dst)
        with self.client.open(src, "rb") as fin, self.client.open(dst, "wb") as fout:
            while piece := fin.read(_COPY_PIECE_BYTES):
                fout.write(piece)

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if truncate or not self.client.exists(path):
            self._make_parent(path)
            with self.client.open(path, "wb"):
                pass
        else:
            self.client.utime(path)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        if not autocommit:
            raise NotImplementedError("fs3 has no fsspec transactions: writes commit on close")
        path = self._strip_protocol(path)
        if any(c in mode for c in "wax"):
            self._make_parent(path)
        return self.client.open(path, mode)

    def created(self, path: str) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.client.stat(self._strip_protocol(path)).st_ctime,
                                               tz=datetime.UTC)

    def modified(self, path: str) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.client.stat(self._strip_protocol(path)).st_mtime,
                                               tz=datetime.UTC)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self.client.exists(self._strip_protocol(path))

    def isdir(self, path: str) -> bool:
        return self.client.isdir(self._strip_protocol(path))

    def isfile(self, path: str) -> bool:
        return self.client.isfile(self._strip_protocol(path))

    def size(self, path: str) -> int:
        return int(self.client.stat(self._strip_protocol(path)).st_size)
