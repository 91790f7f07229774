"""fs3 for asyncio code: ``fs = await fs3.aio.connect("host:port", token=...)``."""

from fs3.client.files import AsyncFile
from fs3.client.fs import AsyncFileSystem, ClientConfig, DirEntry, connect
from fs3.rpc.tls import TlsConfig

__all__ = ["AsyncFile", "AsyncFileSystem", "ClientConfig", "DirEntry", "TlsConfig", "connect"]
