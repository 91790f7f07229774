"""FUSE-agnostic file-system semantics: inode-based operations, open handles, caches, errno."""

from fs3.vfs.core import DirHandle, Vfs, VfsConfig

__all__ = ["DirHandle", "Vfs", "VfsConfig"]
