"""What an operator following docs/operations.md meets at the command line: options where the docs
put them, one-line errors for the usual mistakes, listings that read well. No cluster: each check
runs the parser, a command against a stand-in, or a store on a temporary directory."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest

from fs3 import mgmtd_pb2 as mpb
from fs3.cli.main import build_parser, main
from fs3.cli.moves import run_move_command
from fs3.kv.store import RocksKVStore


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


class _Admin:
    """Answers the move commands as mgmtd would, from canned responses."""

    def __init__(self, now: mpb.MovesRsp, later: mpb.MovesRsp) -> None:
        self.now, self.later = now, later

    async def moves(self) -> mpb.MovesRsp:
        return self.later

    async def rebalance(self, max_moves: int, rate: int, dry_run: bool) -> mpb.MovesRsp:
        return self.now


def _moves(admin: Any, **options: Any) -> int:
    defaults = {"json": False, "wait": False, "dry_run": False, "wait_timeout_s": 5.0}
    return asyncio.run(run_move_command(admin, argparse.Namespace(**{**defaults, **options})))


def test_move_listings_say_when_there_is_nothing_and_print_the_rate_once(capsys: pytest.CaptureFixture[str]) -> None:
    empty = mpb.MovesRsp()
    assert _moves(_Admin(empty, empty), command="drain", nodes=["status"]) == 0
    assert capsys.readouterr().out == "no replica moves\n"
    planned = mpb.MovesRsp(message="moving 0 replica(s)", resync_rate_bytes_per_s=50_000_000)
    assert _moves(_Admin(planned, planned), command="rebalance", max_moves=4, rate=50_000_000, wait=True) == 0
    assert capsys.readouterr().out == "moving 0 replica(s)\nresync rate 50000000 B/s\n"
    drained = mpb.MovesRsp(draining_target_ids=[101, 102], draining_node_ids=[3])
    drained.moves.add(chain_id=1, from_target_id=101, phase="done", reason="drain")
    assert _moves(_Admin(drained, drained), command="moves") == 0
    out = capsys.readouterr().out
    assert "draining (until undrain): nodes 3; targets 101, 102" in out and "[]" not in out


def test_upgrade_of_a_store_a_running_service_holds_is_one_line_saying_stop_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "meta.toml"
    config.write_text(f'data_dir = "{tmp_path}"\nkv_engine = "rocksdb"\ncluster_id = "walk"\n')
    config.chmod(0o600)
    held = RocksKVStore(tmp_path / "kv")  # as the running meta server holds it
    try:
        assert main(["admin", "upgrade", "--config", str(config), "--service", "meta"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "stop it first" in err and "--check" in err
        assert "IO_ERROR: IO_ERROR" not in err
        # --check reads beside the running service.
        assert main(["admin", "upgrade", "--config", str(config), "--service", "meta", "--check"]) == 0
    finally:
        held.close()


def test_load_of_a_missing_file_is_refused_before_the_store_is_made(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "meta.toml"
    config.write_text(f'data_dir = "{tmp_path / "meta"}"\nkv_engine = "rocksdb"\ncluster_id = "walk"\n')
    config.chmod(0o600)
    assert main(["admin", "load", str(tmp_path / "nope.dump"), "--meta-config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "no such dump file" in err and err.count("\n") == 1
    assert not (tmp_path / "meta" / "kv").exists()


def test_a_store_held_by_a_running_meta_is_named_once_when_loading(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "meta.toml"
    config.write_text(f'data_dir = "{tmp_path}"\nkv_engine = "rocksdb"\ncluster_id = "walk"\n')
    config.chmod(0o600)
    dump = tmp_path / "x.dump"
    dump.write_text("{}\n")
    held = RocksKVStore(tmp_path / "kv")
    try:
        assert main(["admin", "load", str(dump), "--meta-config", str(config)]) == 1
    finally:
        held.close()
    err = capsys.readouterr().err
    assert "stop it first" in err and "IO_ERROR: IO_ERROR" not in err and err.count("\n") == 1
