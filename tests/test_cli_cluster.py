"""How a command finds its cluster: a local cluster's cluster.json, or --mgmtd/--token and FS3_TOKEN."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fs3.cli.cluster import resolve_cluster
from fs3.common.errors import InvalidArgument


def _args(**fields: object) -> argparse.Namespace:
    base: dict[str, object] = {"dir": None, "mgmtd": "10.0.0.1:9000", "token": None, "transport": "framed"}
    base.update(fields)
    return argparse.Namespace(**base)


def test_a_local_cluster_directory_names_mgmtd_and_token(tmp_path: Path) -> None:
    (tmp_path / "cluster.json").write_text(json.dumps({
        "mgmtd": "127.0.0.1:9100", "token": "t0",
        "processes": {"mgmtd": {"grpc": "127.0.0.1:9101"}},
    }))
    assert resolve_cluster(_args(dir=str(tmp_path))) == ("127.0.0.1:9100", "t0")
    assert resolve_cluster(_args(dir=str(tmp_path), transport="grpc")) == ("127.0.0.1:9101", "t0")
    assert resolve_cluster(_args(dir=str(tmp_path), token="given")) == ("127.0.0.1:9100", "given")


def test_without_a_directory_the_flags_and_environment_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FS3_TOKEN", raising=False)
    assert resolve_cluster(_args()) == ("10.0.0.1:9000", None)
    monkeypatch.setenv("FS3_TOKEN", "from-env")
    assert resolve_cluster(_args()) == ("10.0.0.1:9000", "from-env")


def test_a_directory_without_a_cluster_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="fs3 local up"):
        resolve_cluster(_args(dir=str(tmp_path / "none")))
