"""FUSE-agnostic file-system semantics: inode-based operations, open handles, caches, errno."""

from fs3.vfs.core import DirHandle, KernelNames, Vfs, VfsConfig

__all__ = ["DirHandle", "KernelNames", "Vfs", "VfsConfig"]
