"""The scrubber of a cluster `fs3 local up` makes: on, at a gentle rate, unless --no-scrub; and its
trash, kept as long as --trash-days says."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fs3.cli.local import LOCAL_SCRUB, NO_SCRUB_ENV, TRASH_DAYS_ENV, LocalCluster
from fs3.common.config import load_config
from fs3.meta.server import MetaConfig
from fs3.storage.server import StorageConfig


def _storage_config(root: Path, environ: dict[str, str] | None = None) -> StorageConfig:
    return load_config(StorageConfig, root / "storage-1" / "storage.toml", env_prefix="FS3_STORAGE",
                       environ=environ or {})


def test_the_local_scrub_is_gentle_and_on() -> None:
    assert LOCAL_SCRUB.enabled
    LOCAL_SCRUB.validate()
    assert 0 < LOCAL_SCRUB.bytes_per_s <= 16 << 20 and 0 < LOCAL_SCRUB.chunks_per_s <= 100


@pytest.mark.parametrize("scrub", [LOCAL_SCRUB, None], ids=["default", "no-scrub"])
def test_a_new_local_cluster_writes_its_scrubber_into_the_storage_configs(tmp_path: Path,
                                                                         scrub: object) -> None:
    LocalCluster(tmp_path, storage_nodes=1, targets_per_node=1, scrub=scrub)  # type: ignore[arg-type]
    text = (tmp_path / "storage-1" / "storage.toml").read_text()
    assert ("scrub" in tomllib.loads(text)) == (scrub is not None)
    config = _storage_config(tmp_path)
    assert config.scrub == (scrub or config.scrub) and config.scrub.enabled == (scrub is not None)
    # --no-scrub on a cluster made with the scrubber on turns it off for that run.
    assert not _storage_config(tmp_path, NO_SCRUB_ENV).scrub.enabled


def test_up_takes_no_scrub() -> None:
    from fs3.cli.main import build_parser

    args = build_parser().parse_args(["local", "up", "--no-scrub"])
    assert args.no_scrub is True
    assert build_parser().parse_args(["local", "up"]).no_scrub is False


def _meta_config(root: Path, environ: dict[str, str] | None = None) -> MetaConfig:
    return load_config(MetaConfig, root / "meta" / "meta.toml", env_prefix="FS3_META", environ=environ or {})


def test_trash_days_go_into_a_new_clusters_meta_config_and_override_an_old_ones(tmp_path: Path) -> None:
    """``fs3 local up --trash-days D``: written into the meta config of a cluster it makes; for a
    cluster made before, set for that run through the environment. Bad values are refused."""
    LocalCluster(tmp_path / "kept", storage_nodes=1, targets_per_node=1, trash_days=2.5)
    assert _meta_config(tmp_path / "kept").service.trash_days == 2.5
    LocalCluster(tmp_path / "off", storage_nodes=1, targets_per_node=1)
    assert _meta_config(tmp_path / "off").service.trash_days == 0
    assert _meta_config(tmp_path / "off", {TRASH_DAYS_ENV: "1.0"}).service.trash_days == 1.0
    from fs3.cli.main import build_parser, main

    assert build_parser().parse_args(["local", "up", "--trash-days", "7"]).trash_days == 7.0
    assert build_parser().parse_args(["local", "up"]).trash_days is None
    for bad in ("-1", "nan", "inf", "3651", "week"):  # refused by the parser: nothing made
        with pytest.raises(SystemExit):
            main(["local", "up", "--dir", str(tmp_path / "bad"), "--trash-days", bad])
    assert not (tmp_path / "bad").exists()
