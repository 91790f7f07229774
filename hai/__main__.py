"""The ``hai`` command (``python -m hai``): one subcommand per part of the platform.

Today: ``hai validate`` (:mod:`hai.validate`), ``hai server`` (:mod:`hai.server`), ``hai agent``
(:mod:`hai.agent`), ``hai local`` (:mod:`hai.local`) and the user commands of :mod:`hai.cli`
(``submit``, ``ls``, ``show``, ``logs``, ``suspend``, ``stop``, ``nodes``, ``quota``).
Exit status 2 is bad usage, as argparse gives it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hai import agent, cli, local, server, validate

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hai", description="HAI Platform: the time-sharing training scheduler")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    checker = commands.add_parser("validate", help="check this node (CPU, memory, GEMM, HFReduce, fs3) and judge it",
                                  description=(validate.__doc__ or "").split("\n")[0])
    validate.add_arguments(checker)
    checker.set_defaults(run=validate.run)
    serving = commands.add_parser("server", help="the HTTP API and the scheduling loop",
                                  description=(server.__doc__ or "").split("\n")[0])
    server.add_arguments(serving)
    serving.set_defaults(run=server.run)
    agenting = commands.add_parser("agent", help="the node agent: registers, heartbeats, runs the ranks",
                                   description=(agent.__doc__ or "").split("\n")[0])
    agent.add_arguments(agenting)
    agenting.set_defaults(run=agent.run)
    localing = commands.add_parser("local", help="a whole platform on this machine: fs3, the server, N agents",
                                   description=(local.__doc__ or "").split("\n")[0])
    local.add_arguments(localing)
    cli.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
