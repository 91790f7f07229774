"""What an operator following docs/operations.md meets at the command line: options where the docs
put them, one-line errors for the usual mistakes, listings that read well. No cluster: each check
runs the parser, a command against a stand-in, or a store on a temporary directory."""

from __future__ import annotations

import pytest

from fs3.cli.main import build_parser


@pytest.mark.parametrize("argv", [
    ["admin", "nodes", "--dir", "D", "--json"],
    ["admin", "--dir", "D", "--json", "nodes"],
    ["admin", "--json", "nodes", "--dir", "D"],
    ["admin", "drain", "3", "--wait", "--dir", "D", "--json"],
    ["admin", "scrub", "status", "--dir", "D", "--json"],
    ["admin", "dump", "--out", "x.dump", "--dir", "D", "--json"],
])
def test_cluster_options_go_before_or_after_an_admin_subcommand(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.dir == "D" and args.json is True


def test_options_a_subcommand_spells_its_own_way_keep_their_meaning() -> None:
    parser = build_parser()
    args = parser.parse_args(["admin", "--token-file", "cluster.tok", "user", "add", "bob", "--uid", "1",
                              "--gid", "1", "--token-file", "bob.tok"])
    assert args.token_file == "cluster.tok" and args.user_token_file == "bob.tok"
    args = parser.parse_args(["admin", "token", "rotate", "--dir", "D"])
    assert args.rotate_dir == "D" and args.dir is None
    with pytest.raises(SystemExit):  # upgrade works on a stopped service's stores: no cluster options
        parser.parse_args(["admin", "upgrade", "--config", "c.toml", "--dir", "D"])
