"""Where a command finds its cluster: shared by every subcommand that connects to one.

Its own module because both the command table (:mod:`fs3.cli.main`) and the subcommands it loads
(:mod:`fs3.cli.bench`) need it; in either of them it would make the two import each other.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from fs3.common.errors import InvalidArgument
from fs3.common.secret_files import read_secret_file, read_token_file

__all__ = ["TOKEN_ARGV_WARNING", "resolve_cluster", "resolve_token", "warn_token_in_argv"]

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
    args.token = resolve_token(args, token_file)
    return args.mgmtd, args.token
