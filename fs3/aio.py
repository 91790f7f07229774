"""fs3 for asyncio code: ``fs = await fs3.aio.connect("host:port", token=...)``."""

from fs3.client.files import AsyncFile
from fs3.client.fs import AsyncFileSystem, ClientConfig, DirEntry, connect

__all__ = ["AsyncFile", "AsyncFileSystem", "ClientConfig", "DirEntry", "connect"]
