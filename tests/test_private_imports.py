"""Tests use fs3 through names fs3 means to be used: no ``from fs3.x import _private``.

A test that imports a module-private name pins an implementation detail, so renaming or inlining it
breaks tests that were not about it, and nothing in fs3 says the name has a caller. When a test needs
such a seam, fs3 gives it a public name (with a docstring saying who uses it); the rare exception is
listed in ``ALLOWED`` with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

ALLOWED: dict[tuple[str, str], str] = {
    # (test file relative to tests/, "module:name") -> why the test may import it. Empty: every seam the
    # tests use has a public name. An entry no import needs any more fails the check (remove it).
}


def private_imports(source: str) -> list[tuple[int, str]]:
    """``(line, "module:name")`` for each import of a private fs3 name (or a name from a private fs3
    module) in ``source``. Private: a leading underscore that is not a dunder (``__main__`` is fine)."""

    def private(part: str) -> bool:
        return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))

    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            parts = node.module.split(".")
            if parts[0] != "fs3":
                continue
            for alias in node.names:
                if private(alias.name) or any(private(p) for p in parts):
                    found.append((node.lineno, f"{node.module}:{alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "fs3" and any(private(p) for p in parts):
                    found.append((node.lineno, f"{'.'.join(parts[:-1])}:{parts[-1]}"))
    return sorted(found)


def violations(files: dict[str, str], allowed: dict[tuple[str, str], str]) -> list[str]:
    """Private imports in ``files`` (name relative to tests/ -> source) not in ``allowed``, and entries
    of ``allowed`` that no import uses."""
    used: set[tuple[str, str]] = set()
    problems: list[str] = []
    for name, source in sorted(files.items()):
        for line, what in private_imports(source):
            if (name, what) in allowed:
                used.add((name, what))
            else:
                problems.append(f"tests/{name}:{line}: imports the private {what}")
    problems += [f"ALLOWED lists {name} {what}, which no test imports any more" for name, what in allowed
                 if (name, what) not in used]
    return problems


def test_tests_import_no_private_fs3_names() -> None:
    files = {str(path.relative_to(TESTS)): path.read_text() for path in sorted(TESTS.rglob("*.py"))}
    assert len(files) > 40
    assert violations(files, ALLOWED) == []


def test_the_check_catches_private_imports() -> None:
    source = (
        "from fs3.meta.server import MetaConfig, _heartbeat_loop\n"
        "from fs3.fuse.ops import _errors as errors\n"
        "import fs3._internal.thing\n"
        "from fs3._internal import public\n"
        "from fs3.sim.__main__ import main\n"  # a dunder is not private
        "from tests.inproc import _helper\n"  # not fs3
        "from fs3.client.admin import Seen\n"
        "def f():\n    from fs3.cli.main import _parser\n"  # inside a function too
    )
    assert private_imports(source) == [(1, "fs3.meta.server:_heartbeat_loop"), (2, "fs3.fuse.ops:_errors"),
                                       (3, "fs3._internal:thing"), (4, "fs3._internal:public"),
                                       (9, "fs3.cli.main:_parser")]
    problems = violations({"test_x.py": source}, {("test_x.py", "fs3.fuse.ops:_errors"): "a reason",
                                                  ("test_y.py", "fs3.meta.ops:_gone"): "stale"})
    assert problems == [
        "tests/test_x.py:1: imports the private fs3.meta.server:_heartbeat_loop",
        "tests/test_x.py:3: imports the private fs3._internal:thing",
        "tests/test_x.py:4: imports the private fs3._internal:public",
        "tests/test_x.py:9: imports the private fs3.cli.main:_parser",
        "ALLOWED lists test_y.py fs3.meta.ops:_gone, which no test imports any more",
    ]
