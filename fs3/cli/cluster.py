"""Where a command finds its cluster, and how it reaches it: shared by every subcommand that connects to one.

Its own module because both the command table (:mod:`fs3.cli.main`) and the subcommands it loads
(:mod:`fs3.cli.bench`) need it; in either of them it would make the two import each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from fs3.common.config import load_config
from fs3.common.errors import InvalidArgument
from fs3.rpc.tls import TlsConfig

__all__ = ["add_tls_arguments", "client_tls", "resolve_cluster", "tls_from_env"]

_TLS_KEYS = ("ca_file", "cert_file", "key_file", "server_name")


def resolve_cluster(args: argparse.Namespace) -> tuple[str, str | None]:
    """mgmtd address and token from ``--dir`` (a local cluster's cluster.json) or ``--mgmtd``/``--token``."""
    transport = getattr(args, "transport", "framed")
    if args.dir:
        info_path = Path(args.dir) / "cluster.json"
        if not info_path.exists():
            raise InvalidArgument(f"no {info_path}: start one with fs3 local up --dir {args.dir}")
        info = json.loads(info_path.read_text())
        args.mgmtd = info["processes"]["mgmtd"][transport] if transport == "grpc" else info["mgmtd"]
        args.token = args.token or info["token"]
        for key, value in (info.get("tls") or {}).items():
            if key in _TLS_KEYS and not getattr(args, f"tls_{key}", None):
                setattr(args, f"tls_{key}", value)
    return args.mgmtd, args.token or os.environ.get("FS3_TOKEN") or None


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
