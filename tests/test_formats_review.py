"""Format upgrades as an operator meets them: `fs3 admin upgrade` pointed at the wrong place,
damaged format and progress records, and migrations cut short."""

from __future__ import annotations

from pathlib import Path

import pytest

from fs3.cli.main import main


def _storage_config(root: Path, target: Path) -> Path:
    config = root / "storage.toml"
    config.write_text(f'node_id = 1\n\n[[targets]]\ntarget_id = 101\npath = "{target}"\n')
    config.chmod(0o600)
    return config


@pytest.mark.parametrize("check", [False, True])
def test_upgrade_of_a_store_that_is_not_there_fails_and_creates_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], check: bool) -> None:
    """A typo in the config, or a disk that is not mounted: the offline upgrade must not make
    (and stamp) an empty store where the data should be, and must not report success."""
    target = tmp_path / "not-mounted" / "target-1"
    config = _storage_config(tmp_path, target)
    assert main(["admin", "upgrade", "--config", str(config), *(["--check"] if check else [])]) == 1
    err = capsys.readouterr().err
    assert str(target / "meta") in err and "no RocksDB" in err, err
    assert not (tmp_path / "not-mounted").exists()
