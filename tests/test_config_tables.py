"""Components' settings as nested tables of the process configs, and the keys that moved there."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from fs3.common.config import load_config
from fs3.common.errors import InvalidArgument
from fs3.meta.server import MetaConfig
from fs3.storage.replica import ReplicaConfig
from fs3.storage.server import StorageConfig

_TARGETS = '[[targets]]\ntarget_id = 1\npath = "/x"\n'


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_every_replica_knob_is_settable_in_its_table(tmp_path: Path) -> None:
    text = ("node_id = 1\n[replica]\nrouting_wait_ms = 50\nquery_timeout_ms = 700\noffload_write_min_bytes = 1024\n"
            f"patch_max_bytes = 0\nforward_retry_total_ms = 1000\n{_TARGETS}")
    config = load_config(StorageConfig, _write(tmp_path, text), env_prefix="FS3_STORAGE", environ={})
    assert config.replica == ReplicaConfig(routing_wait_ms=50, query_timeout_ms=700, offload_write_min_bytes=1024,
                                           patch_max_bytes=0, forward_retry_total_ms=1000)


def test_table_keys_come_from_the_environment(tmp_path: Path) -> None:
    config = load_config(StorageConfig, _write(tmp_path, f"node_id = 1\n{_TARGETS}"), env_prefix="FS3_STORAGE",
                         environ={"FS3_STORAGE_REPLICA_PATCH_MAX_BYTES": "4096"})
    assert config.replica.patch_max_bytes == 4096
    meta = load_config(MetaConfig, None, env_prefix="FS3_META", environ={"FS3_META_SERVICE_ROOT_MODE": "511"})
    assert meta.service.root_mode == 0o777


def test_a_moved_key_still_works_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write(tmp_path, f"node_id = 1\nforward_timeout_ms = 2000\ndirty_read_policy = \"retry\"\n{_TARGETS}")
    with caplog.at_level(logging.WARNING):
        config = load_config(StorageConfig, path, env_prefix="FS3_STORAGE", environ={})
    assert config.replica.forward_timeout_ms == 2000 and config.replica.dirty_read_policy == "retry"
    assert "'forward_timeout_ms' is deprecated at the top level; set it in the [replica] table" in caplog.text
    meta = load_config(MetaConfig, None, env_prefix="FS3_META", environ={"FS3_META_ROOT_MODE": "511"})
    assert meta.service.root_mode == 0o777


def test_the_table_wins_over_a_moved_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "prune_interval_ms = 100\n[service]\nprune_interval_ms = 300\n")
    assert load_config(MetaConfig, path, env_prefix="FS3_META", environ={}).service.prune_interval_ms == 300


def test_the_environment_wins_over_the_file_under_a_moved_name(tmp_path: Path) -> None:
    """The environment overrides the file, whichever name each uses: an operator's old-style
    FS3_STORAGE_FORWARD_TIMEOUT_MS is not silently beaten by a [replica] table in the file."""
    path = _write(tmp_path, f"node_id = 1\n{_TARGETS}[replica]\nforward_timeout_ms = 100\n")
    config = load_config(StorageConfig, path, env_prefix="FS3_STORAGE",
                         environ={"FS3_STORAGE_FORWARD_TIMEOUT_MS": "777"})
    assert config.replica.forward_timeout_ms == 777
    both = load_config(StorageConfig, path, env_prefix="FS3_STORAGE",
                       environ={"FS3_STORAGE_FORWARD_TIMEOUT_MS": "777",
                                "FS3_STORAGE_REPLICA_FORWARD_TIMEOUT_MS": "888"})
    assert both.replica.forward_timeout_ms == 888  # in the environment too, the table's name wins


def test_meta_root_owner_defaults_to_the_user_running_it_with_a_partial_table(tmp_path: Path) -> None:
    config = load_config(MetaConfig, _write(tmp_path, "[service]\nroot_mode = 0o700\n"), env_prefix="FS3_META",
                         environ={})
    assert (config.service.root_uid, config.service.root_gid, config.service.root_mode) == (-1, -1, 0o700)
    resolved = config.service_config()
    assert (resolved.root_uid, resolved.root_gid) == (os.getuid(), os.getgid())


@pytest.mark.parametrize(
    ("cls", "text", "message"),
    [
        (StorageConfig, f"node_id = 1\n[replica]\nforward_timout_ms = 1\n{_TARGETS}",
         r"config\.toml\.replica: unknown key\(s\) forward_timout_ms; known: .*forward_timeout_ms"),
        (StorageConfig, f"node_id = 1\n[replica]\ndirty_read_policy = \"never\"\n{_TARGETS}", "dirty_read_policy"),
        (StorageConfig, f"node_id = 1\nreplica = 3\n{_TARGETS}", "expected a table"),
        (StorageConfig, f"node_id = 1\n[replica]\nrouting_wait_ms = 0\n{_TARGETS}", "routing_wait_ms"),
        (MetaConfig, "[service]\nclient_lease_ms = 10\n", "client_lease_ms"),
        (MetaConfig, "[service]\nchunk_page = 0\n", "chunk_page"),
        (MetaConfig, "[servic]\nroot_mode = 1\n", r"unknown key\(s\) servic"),
        (MetaConfig, "root_mode = 0o17777\n", "root_mode"),
    ],
)
def test_bad_table_keys_are_a_clear_error(tmp_path: Path, cls: type[object], text: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        load_config(cls, _write(tmp_path, text), env_prefix="FS3_X", environ={})
