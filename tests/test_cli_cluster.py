"""How a command finds its cluster: a local cluster's cluster.json, or --mgmtd/--token and FS3_TOKEN."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fs3.cli.cluster import resolve_cluster
from fs3.common.errors import InvalidArgument
from fs3.common.secret_files import write_secret_file, write_token_file


def _args(**fields: object) -> argparse.Namespace:
    base: dict[str, object] = {"dir": None, "mgmtd": "10.0.0.1:9000", "token": None, "transport": "framed"}
    base.update(fields)
    return argparse.Namespace(**base)


def test_a_local_cluster_directory_names_mgmtd_and_token(tmp_path: Path) -> None:
    write_token_file(tmp_path / "token", ["t0"])
    write_secret_file(tmp_path / "cluster.json", json.dumps({
        "mgmtd": "127.0.0.1:9100", "token_file": str(tmp_path / "token"),
        "processes": {"mgmtd": {"grpc": "127.0.0.1:9101"}},
    }))
    assert resolve_cluster(_args(dir=str(tmp_path))) == ("127.0.0.1:9100", "t0")
    assert resolve_cluster(_args(dir=str(tmp_path), transport="grpc")) == ("127.0.0.1:9101", "t0")
    assert resolve_cluster(_args(dir=str(tmp_path), token="given")) == ("127.0.0.1:9100", "given")
    # cluster.json names where the secret is: a copy other users can read is refused, saying how to fix it.
    (tmp_path / "cluster.json").chmod(0o644)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        resolve_cluster(_args(dir=str(tmp_path)))


def test_without_a_directory_the_flags_and_environment_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FS3_TOKEN", raising=False)
    assert resolve_cluster(_args()) == ("10.0.0.1:9000", None)
    monkeypatch.setenv("FS3_TOKEN", "from-env")
    assert resolve_cluster(_args()) == ("10.0.0.1:9000", "from-env")


def test_a_directory_without_a_cluster_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="fs3 local up"):
        resolve_cluster(_args(dir=str(tmp_path / "none")))
