"""Where a command finds its cluster: shared by every subcommand that connects to one.

Its own module because both the command table (:mod:`fs3.cli.main`) and the subcommands it loads
(:mod:`fs3.cli.bench`) need it; in either of them it would make the two import each other.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from fs3.common.errors import InvalidArgument

__all__ = ["resolve_cluster"]


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
    return args.mgmtd, args.token or os.environ.get("FS3_TOKEN") or None
