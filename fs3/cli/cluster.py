"""Where a command finds its cluster, and how it reaches it: shared by every subcommand that connects to one.

Its own module because both the command table (:mod:`fs3.cli.main`) and the subcommands it loads
(:mod:`fs3.cli.bench`) need it; in either of them it would make the two import each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from fs3.common.config import load_config
from fs3.common.errors import InvalidArgument
from fs3.common.secret_files import read_secret_file, read_token_file

if TYPE_CHECKING:
    from fs3.client.meta import Meta
from fs3.rpc.tls import TlsConfig

__all__ = ["TOKEN_ARGV_WARNING", "add_tls_arguments", "check_address", "client_tls", "number_in", "resolve_cluster",
           "resolve_token", "tls_from_env", "warn_token_in_argv"]

N = TypeVar("N", int, float)


def number_in(convert: Callable[[str], N], low: N, high: N, what: str) -> Callable[[str], N]:
    """An argparse type for a number a user sizes: ``what`` from ``low`` to ``high``, a clear
    one-line error otherwise (every such option is bounded)."""
    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"not {what} from {low} to {high}: {value}")
        return value

    return parse

_TLS_KEYS = ("ca_file", "cert_file", "key_file", "server_name")
TOKEN_ARGV_WARNING = ("fs3: warning: --token shows the token to every local user (ps, /proc/PID/cmdline); "
                      "use --token-file FILE or $FS3_TOKEN")


def warn_token_in_argv(args: argparse.Namespace) -> None:
    """Say so when a token was given on the command line, where every local user can read it."""
    if getattr(args, "token", None):
        print(TOKEN_ARGV_WARNING, file=sys.stderr)


def resolve_token(args: argparse.Namespace, token_file: str | None = None) -> str | None:
    """The token to present: ``--token`` (warned about), ``--token-file``, ``token_file`` (a local
    cluster's), ``$FS3_TOKEN``; the first line of a token file (during a rotation, the new token)."""
    warn_token_in_argv(args)
    if getattr(args, "token", None):
        return str(args.token)
    path = getattr(args, "token_file", None) or token_file
    if path:
        return read_token_file(path)[0]
    return os.environ.get("FS3_TOKEN") or None


def check_address(address: str, what: str = "mgmtd") -> str:
    """``address`` if it is ``HOST:PORT`` (``[v6]:PORT`` too; for mgmtd, several comma-separated:
    the instances of a highly available mgmtd), else a one-line InvalidArgument naming the option,
    before any connection is tried."""
    for one in address.split(",") if what == "mgmtd" else [address]:
        host, sep, port = one.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"bad {what} address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:9000"
                                  + (" (several mgmtd: comma-separated)" if what == "mgmtd" else ""))
    return address


def resolve_cluster(args: argparse.Namespace) -> tuple[str, str | None]:
    """mgmtd address and token from ``--dir`` (a local cluster's cluster.json, which names its
    token file) or ``--mgmtd`` and ``--token-file``/``$FS3_TOKEN``; ``args.token`` is set to the token."""
    transport = getattr(args, "transport", "framed")
    token_file = None
    if args.dir:
        info_path = Path(args.dir) / "cluster.json"
        if not info_path.exists():
            raise InvalidArgument(f"no {info_path}: start one with fs3 local up --dir {args.dir}")
        info = json.loads(read_secret_file(info_path))
        args.mgmtd = info["processes"]["mgmtd"][transport] if transport == "grpc" else info["mgmtd"]
        token_file = info.get("token_file")
        if token_file and not getattr(args, "token_file", None) and not getattr(args, "token", None):
            args.token_file = token_file  # read again on SIGHUP by a mount (a rotation)
        for key, value in (info.get("tls") or {}).items():
            if key in _TLS_KEYS and not getattr(args, f"tls_{key}", None):
                setattr(args, f"tls_{key}", value)
    check_address(args.mgmtd)
    args.token = resolve_token(args, token_file)
    return args.mgmtd, args.token


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-ca-file`` and friends: a client's side of mutual TLS (default: ``$FS3_TLS_CA_FILE``...)."""
    parser.add_argument("--tls-ca-file", help="the cluster's CA certificate: turns TLS on (default: $FS3_TLS_CA_FILE)")
    parser.add_argument("--tls-cert-file", help="this client's certificate (default: $FS3_TLS_CERT_FILE)")
    parser.add_argument("--tls-key-file", help="this client's private key, mode 0600 (default: $FS3_TLS_KEY_FILE)")
    parser.add_argument("--tls-server-name", help="the name servers' certificates carry, if not their host "
                                                  "(default: $FS3_TLS_SERVER_NAME)")


def tls_from_env() -> TlsConfig | None:
    """A client's ``[tls]`` settings from ``FS3_TLS_<KEY>`` (``FS3_TLS_CA_FILE``...); None when TLS is off."""
    config = load_config(TlsConfig, None, env_prefix="FS3_TLS")
    return config if config.enabled else None


def client_tls(args: argparse.Namespace) -> TlsConfig | None:
    """The client's ``[tls]`` settings: flags first, then ``FS3_TLS_<KEY>``; None when TLS is off."""
    config = load_config(TlsConfig, None, env_prefix="FS3_TLS")
    flags = {key: value for key in _TLS_KEYS if (value := getattr(args, f"tls_{key}", None))}
    if flags:
        config = dataclasses.replace(config, **flags)
        config.validate()
    return config if config.enabled else None


async def run_with_metadata(args: argparse.Namespace,
                            command: Callable[[Meta, argparse.Namespace], Awaitable[int]]) -> int:
    """Runs ``command`` with a metadata client of the cluster the cluster options name, closing it
    after; its exit status (``fs3 trash``, ``fs3 quota``)."""
    from fs3.client.fs import ClientConfig, connect

    resolve_cluster(args)
    config = ClientConfig(transport=args.transport, tls=client_tls(args), rpc_timeout_ms=args.timeout_ms)
    fs = await connect(args.mgmtd, args.token, config)
    try:
        return await command(fs.metadata, args)
    finally:
        await fs.close()
