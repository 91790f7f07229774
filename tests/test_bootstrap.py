"""scripts/bootstrap.sh's one way to install a Debian package whose service must not start
(prometheus for promtool, postgresql for the tests' private server), run with a fake apt-get and
systemctl: service starts are refused while it installs, the unit is disabled afterwards, and the
refusal is removed again."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bootstrap.sh"


def _function() -> str:
    text = SCRIPT.read_text()
    found = re.search(r"^install_without_service\(\) \{\n.*?^\}\n", text, re.S | re.M)
    assert found is not None, "bootstrap.sh defines install_without_service"
    return found.group(0)


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_every_service_package_goes_through_the_one_function() -> None:
    text = SCRIPT.read_text()
    assert text.count("policy-rc.d") == 2, "one policy-rc.d block (and its comment), in the function"
    assert "install_without_service prometheus " in text and "install_without_service postgresql " in text


def test_a_package_installs_with_service_starts_refused_then_its_unit_disabled(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the function installs only as root")
    bin_dir, log, policy = tmp_path / "bin", tmp_path / "calls.log", tmp_path / "policy-rc.d"
    bin_dir.mkdir()
    _fake(bin_dir, "apt-get", f'echo "apt-get $* policy=$(cat {policy} | tail -1)" >> {log}\n')
    _fake(bin_dir, "systemctl", f'echo "systemctl $*" >> {log}\n')
    script = _function() + "install_without_service postgresql 'it skips'\n"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "POLICY_RC_D": str(policy)}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert calls == ["apt-get install -y -qq --no-install-recommends postgresql policy=exit 101",
                     "systemctl disable --quiet postgresql.service"]
    assert not policy.exists(), "the refusal is removed after the install"
