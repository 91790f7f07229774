"""The module map holds, and its checks catch what they are for.

Two checks keep the layers of docs/architecture.md:

* the import contracts in pyproject.toml (``[tool.importlinter]``, run by ``lint-imports`` in
  ``make test``): fs3's own packages, and the pure cores beside it (``hai.rules``, ``hai.advice``,
  ``hai.validation_rules``). Each contract is run here against a copy of the root packages with a
  violation planted, and must break — a contract that names a module wrongly, or forbids the wrong
  thing, would otherwise pass forever.
* :func:`outside_violations`: every other top-level package of the repository (``cluster_model``
  today, and the packages built on the client as they appear) imports fs3 only through the public
  API listed in ``[tool.fs3.layering]``. import-linter cannot say "only these", nor check a package
  that does not exist yet; this walks whatever packages exist.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def layering_config() -> tuple[frozenset[str], frozenset[str]]:
    """``(public_api, internal)``: the fs3 modules others may import; the packages exempt (fs3, tests, bench)."""
    table = _pyproject()["tool"]["fs3"]["layering"]
    return frozenset(table["public_api"]), frozenset(table["internal"])


# -- outside packages use only the public API ---------------------------------------------------


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    module: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.module}"


def _is_module(fs3_root: Path, dotted: str) -> bool:
    """Whether ``dotted`` (``fs3.x.y``) names a module or package of the fs3 source tree."""
    parts = dotted.split(".")[1:]
    base = fs3_root.joinpath(*parts) if parts else fs3_root
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def fs3_imports(source: str, fs3_root: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every fs3 module ``source`` imports, wherever the import stands
    (module level, inside functions, under ``TYPE_CHECKING``). ``from fs3.a import b`` imports
    ``fs3.a.b`` when that is a module, else ``fs3.a``."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names
                    if alias.name == "fs3" or alias.name.startswith("fs3.")]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module is not None \
                and (node.module == "fs3" or node.module.startswith("fs3.")):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                out.append((node.lineno, child if _is_module(fs3_root, child) else node.module))
    return out


def top_level_packages(root: Path, internal: frozenset[str]) -> list[Path]:
    """The repository's top-level packages (directories with ``__init__.py``) not exempt."""
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and (p / "__init__.py").is_file() and p.name not in internal)


def outside_violations(root: Path, fs3_root: Path, public: frozenset[str],
                       internal: frozenset[str]) -> list[Violation]:
    """Imports of fs3 modules outside ``public`` by any top-level package not in ``internal``."""
    found: list[Violation] = []
    for package in top_level_packages(root, internal):
        for path in sorted(package.rglob("*.py")):
            for line, module in fs3_imports(path.read_text(), fs3_root):
                if module not in public:
                    found.append(Violation(path.relative_to(root), line, module))
    return found


def test_packages_beside_fs3_use_only_its_public_api() -> None:
    public, internal = layering_config()
    packages = [p.name for p in top_level_packages(ROOT, internal)]
    assert "cluster_model" in packages  # the walk sees the packages there are
    for module in public:
        assert _is_module(ROOT / "fs3", module), f"public API entry {module} is no fs3 module"
    violations = outside_violations(ROOT, ROOT / "fs3", public, internal)
    assert not violations, "use fs3's public API (pyproject.toml [tool.fs3.layering]):\n" + \
        "\n".join(map(str, violations))


def test_a_new_package_reaching_into_fs3_is_caught(tmp_path: Path) -> None:
    public, internal = layering_config()
    package = tmp_path / "hfreduce"
    package.mkdir()
    (package / "__init__.py").write_text("import fs3\nfrom fs3 import aio, connect\n")
    (package / "ring.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import fs3.client.fsspec_impl\n"
        "from fs3.client import fsspec_impl\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from fs3.client import fs\n"
        "def run() -> None:\n"
        "    from fs3.meta.ops import Namespace\n"
        "    import fs3.storage.craq\n"
        "    from fs3 import meta_pb2\n"
    )
    (tmp_path / "tests").mkdir()  # exempt: tests reach into fs3 on purpose
    (tmp_path / "tests" / "__init__.py").write_text("from fs3.meta import ops\n")
    (tmp_path / "notes").mkdir()  # no package: not walked
    (tmp_path / "notes" / "x.py").write_text("import fs3.meta\n")
    found = outside_violations(tmp_path, ROOT / "fs3", public, internal)
    assert [(str(v.path), v.line, v.module) for v in found] == [
        ("hfreduce/ring.py", 6, "fs3.client.fs"),
        ("hfreduce/ring.py", 8, "fs3.meta.ops"),
        ("hfreduce/ring.py", 9, "fs3.storage.craq"),
        ("hfreduce/ring.py", 10, "fs3.meta_pb2"),
    ]


# -- every import contract is live ----------------------------------------------------------------

# For each contract in pyproject.toml: lines planted in a copy of fs3 (file -> line) that break it,
# and what the report must then say. A new contract needs an entry here (the test says so).
_PLANTED: dict[str, tuple[dict[str, str], list[str]]] = {
    "layers": (
        {"fs3/common/_planted.py": "import fs3.client.fs", "fs3/meta/_planted.py": "import fs3.storage.node",
         "fs3/kv/_planted.py": "import fs3.rpc.channel"},
        ["fs3.common is not allowed to import fs3.client", "fs3.meta is not allowed to import fs3.storage",
         "fs3.kv is not allowed to import fs3.rpc"],
    ),
    "pure-cores": (
        {"fs3/common/layout.py": "import time", "fs3/common/posix.py": "import random",
         "fs3/common/target_state.py": "import secrets", "fs3/kv/api.py": "import asyncio",
         "fs3/meta/ops.py": "import fs3.rpc.channel", "fs3/mgmtd/chain_state.py": "import fs3.common.clock",
         "fs3/storage/craq.py": "import grpc", "hai/rules.py": "import time\nimport sqlalchemy",
         "hai/validation_rules.py": "import time\nimport fastapi", "hai/advice.py": "import random"},
        ["fs3.common.layout is not allowed to import time", "fs3.common.posix is not allowed to import random",
         "fs3.common.target_state is not allowed to import secrets", "fs3.kv.api is not allowed to import asyncio",
         "fs3.meta.ops is not allowed to import fs3.rpc", "fs3.mgmtd.chain_state is not allowed to import "
         "fs3.common.clock", "fs3.storage.craq is not allowed to import grpc",
         "hai.rules is not allowed to import time", "hai.rules is not allowed to import sqlalchemy",
         "hai.validation_rules is not allowed to import time",
         "hai.validation_rules is not allowed to import fastapi", "hai.advice is not allowed to import random"],
    ),
    "meta-ops-on-protocol": (
        {"fs3/meta/ops.py": "from fs3.kv.txn import OptimisticTxnEngine"},
        ["fs3.meta.ops is not allowed to import fs3.kv.txn"],
    ),
    "client-no-servers": (
        {"fs3/client/_planted.py": "import fs3.meta.ops", "fs3/vfs/_planted.py": "import fs3.storage.craq",
         "fs3/fuse/_planted.py": "import fs3.mgmtd.chain_state", "fs3/aio.py": "import fs3.kv.api"},
        ["fs3.client is not allowed to import fs3.meta", "fs3.vfs is not allowed to import fs3.storage",
         "fs3.fuse is not allowed to import fs3.mgmtd", "fs3.aio is not allowed to import fs3.kv"],
    ),
    "storage-no-meta": (
        {"fs3/storage/_planted.py": "from fs3.meta import schema"},
        ["fs3.storage is not allowed to import fs3.meta"],
    ),
    "usrbio-talks-to-the-daemon": (
        {"fs3/usrbio.py": "import fs3.client.read_many"},
        ["fs3.usrbio is not allowed to import fs3.client"],
    ),
    "cli-layers": (
        {"fs3/cli/cluster.py": "from fs3.cli.main import main"},
        ["fs3.cli.cluster is not allowed to import fs3.cli.main"],
    ),
}


def _lint_imports(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert command, "lint-imports is not installed (pip install the test extras)"
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the copy, not the fs3 installed in the environment
    return subprocess.run([command, "--no-logo", "--config", str(cwd / "pyproject.toml"),
                           "--cache-dir", str(cwd / ".cache"), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def fs3_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("layering")
    for package in _pyproject()["tool"]["importlinter"]["root_packages"]:  # fs3, and the pure cores beside it
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def test_every_contract_has_a_planted_violation() -> None:
    ids = [c["id"] for c in _pyproject()["tool"]["importlinter"]["contracts"]]
    assert sorted(ids) == sorted(_PLANTED)


@pytest.mark.slow  # lint-imports in subprocesses (make check runs lint-imports itself)
def test_the_contracts_hold_on_the_pristine_copy(fs3_copy: Path) -> None:
    result = _lint_imports(fs3_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(_PLANTED)} kept, 0 broken" in result.stdout


@pytest.mark.slow  # lint-imports in subprocesses (make check runs lint-imports itself)
@pytest.mark.parametrize("contract", sorted(_PLANTED))
def test_each_contract_catches_its_planted_violation(fs3_copy: Path, contract: str) -> None:
    planted, expected = _PLANTED[contract]
    saved: dict[Path, str | None] = {}
    try:
        for name, line in planted.items():
            path = fs3_copy / name
            saved[path] = path.read_text() if path.exists() else None
            path.write_text((saved[path] or "") + f"\n{line}\n")
        result = _lint_imports(fs3_copy, "--contract", contract)
    finally:
        for path, text in saved.items():
            if text is None:
                path.unlink()
            else:
                path.write_text(text)
    report = result.stdout + result.stderr
    assert result.returncode != 0 and "BROKEN" in report, report
    for phrase in expected:
        assert phrase in report, f"{phrase!r} missing from:\n{report}"
