"""The wheel: built once from a copy of the source tree that has no generated protobuf modules (as a fresh
checkout or the sdist), it must carry every package, the generated modules, the .proto files, the data files
the packages read at run time and the console scripts, and nothing from tests/, bench/ or a virtualenv.
`make test-wheel` installs such a wheel into a fresh venv and runs a cluster from it (scripts/test_wheel.sh)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("fs3", "hfreduce", "haiscale", "hai", "cluster_model")
PROTOS = sorted((REPO / "proto" / "fs3").glob("*.proto"))
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
STALE = ("fs3/gone_pb2.py", "fs3/gone_pb2.pyi", "fs3/gone_pb2_grpc.py", "fs3/proto/fs3/gone.proto", "fs3/meta_pb2.py")

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed (lists the source files)")


def source_files() -> list[str]:
    """The files a checkout has: tracked ones and new ones not git-ignored (so generated modules are left out)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout
    return [name for name in listed.split("\0") if name and (REPO / name).is_file()]


def package_files() -> list[str]:
    """The source tree's files inside the five packages, as wheel paths."""
    return [name for name in source_files() if name.split("/", 1)[0] in PACKAGES and "__pycache__" not in name]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A wheel built with this interpreter's setuptools and grpcio-tools (no download) from a pb2-free copy
    (but for stale generated files a checkout may hold, which the build must leave out)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    for name in source_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    assert not list((src / "fs3").glob("*_pb2*")), "the copy must start without generated modules"
    assert not (src / "fs3" / "proto").exists()
    # What a checkout may hold from `make proto` of an older tree: the build must take none of it.
    for stale in STALE:
        (src / stale).parent.mkdir(parents=True, exist_ok=True)
        (src / stale).write_text("raise ImportError('a stale generated file')\n")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                             "-w", str(root / "dist"), str(src)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = list((root / "dist").glob("fs3-*.whl"))
    assert len(wheels) == 1, wheels
    yield wheels[0]


@pytest.fixture(scope="module")
def names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def dist_info(names: set[str]) -> str:
    (folder,) = {name.split("/", 1)[0] for name in names if name.split("/", 1)[0].endswith(".dist-info")}
    return folder


def test_every_module_of_every_package_is_in_the_wheel(names: set[str]) -> None:
    python = [name for name in package_files() if name.endswith(".py")]
    packages = {name.rsplit("/", 1)[0] for name in python if name.endswith("/__init__.py")}
    assert {"fs3/cli", "fs3/meta", "hai", "haiscale/checkpoint", "hfreduce", "cluster_model"} <= packages
    missing = sorted(name for name in python if name not in names)
    assert not missing, f"not in the wheel: {missing}"


def test_generated_modules_and_shipped_protos(wheel: Path, names: set[str]) -> None:
    assert PROTOS, "proto/fs3/*.proto: nothing to generate from"
    for proto in PROTOS:
        for suffix in GENERATED_SUFFIXES:
            assert f"fs3/{proto.stem}{suffix}" in names
        assert f"fs3/proto/fs3/{proto.name}" in names
        with zipfile.ZipFile(wheel) as archive:
            assert archive.read(f"fs3/proto/fs3/{proto.name}") == proto.read_bytes()


def test_no_stale_generated_file_of_the_checkout(wheel: Path, names: set[str]) -> None:
    """Generated files the source tree held (a .proto since removed, an older make proto) stay out."""
    assert not [name for name in names if "gone" in name]
    with zipfile.ZipFile(wheel) as archive:
        assert b"stale" not in archive.read("fs3/meta_pb2.py")


def test_data_files_are_in_the_wheel(names: set[str]) -> None:
    data = [name for name in package_files() if not name.endswith(".py")]
    # What the packages read at run time: the model's reference figures, measured inputs and designs.
    assert {"cluster_model/data/fire_flyer_2.toml", "fs3/py.typed"} <= set(data)
    assert any(name.startswith("cluster_model/inputs/") and name.endswith(".json") for name in data)
    assert any(name.startswith("cluster_model/examples/") and name.endswith(".toml") for name in data)
    missing = sorted(name for name in data if name not in names)
    assert not missing, f"package files not in the wheel (add them to [tool.setuptools.package-data]): {missing}"


def test_entry_points_match_pyproject(wheel: Path, names: set[str]) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    parser = configparser.ConfigParser()
    parser.optionxform = str  # type: ignore[assignment, method-assign]  # names are case-sensitive
    with zipfile.ZipFile(wheel) as archive:
        parser.read_string(archive.read(f"{dist_info(names)}/entry_points.txt").decode())
    assert dict(parser["console_scripts"]) == project["scripts"]
    assert "fs3" in project["scripts"]
    for group, entries in project.get("entry-points", {}).items():
        assert dict(parser[group]) == entries


def test_nothing_but_the_packages(names: set[str]) -> None:
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {*PACKAGES, dist_info(names)}, tops
    assert not [name for name in names if "__pycache__" in name or name.endswith((".pyc", ".so"))]


def test_metadata_declares_the_runtime_floors(wheel: Path, names: set[str]) -> None:
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"{dist_info(names)}/METADATA").decode()
    assert "License-Expression: MIT" in metadata
    requires = [line.removeprefix("Requires-Dist: ") for line in metadata.splitlines()
                if line.startswith("Requires-Dist: ") and "extra ==" not in line]
    for package in ("protobuf", "grpcio", "rocksdict", "uvloop"):
        assert any(r.split(">=")[0].split("[")[0].strip() == package for r in requires), package


def test_the_wheel_imports_outside_the_repository(wheel: Path, tmp_path: Path) -> None:
    """The generated modules load under this runtime, and the model finds its packaged data, from the
    unpacked wheel alone: no path into the source tree."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    code = ("import fs3.common_pb2, fs3.meta_pb2_grpc, fs3.mgmtd_pb2_grpc, fs3.storage_pb2_grpc\n"
            "from cluster_model.cluster import load_cluster\n"
            "from cluster_model.measured import DEFAULT_MEASURED\n"
            "assert DEFAULT_MEASURED.is_file(), DEFAULT_MEASURED\n"
            "load_cluster()\n"
            "print(fs3.meta_pb2_grpc.__file__)\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r})\n{code}"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).is_relative_to(site)


# -- setup.py's build step, its failure cases --------------------------------------------------------

@pytest.fixture(scope="module")
def setup_module() -> ModuleType:
    """setup.py as a module (its `setup()` call runs only as __main__, as the build backend runs it);
    executed from its text, so no __pycache__ appears in the repository."""
    path = REPO / "setup.py"
    module = ModuleType("fs3_setup")
    module.__file__ = str(path)
    sys.modules["fs3_setup"] = module  # classes look their module up while being defined
    try:
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    finally:
        del sys.modules["fs3_setup"]
    return module


def test_declared_floor_reads_requirement_strings(setup_module: ModuleType) -> None:
    floor = setup_module.declared_floor
    assert floor(["grpcio-reflection>=1.60", "grpcio>=1.85.1"], "grpcio") == "1.85.1"
    assert floor(["psycopg[binary]>=3.1,<4"], "psycopg") == "3.1"
    assert floor(["protobuf<8 ; python_version>'3'"], "protobuf") is None
    assert floor(["uvloop>=0.19"], "protobuf") is None


def test_generated_code_newer_than_the_declared_floor_fails_the_build(setup_module: ModuleType,
                                                                     tmp_path: Path) -> None:
    out = tmp_path / "out"
    setup_module.generate_protos(REPO / "proto", out)
    stamped = (out / "fs3" / "common_pb2.py").read_text().split("# Protobuf Python Version: ")[1].split()[0]
    grpc_stamped = (out / "fs3" / "meta_pb2_grpc.py").read_text().split("GRPC_GENERATED_VERSION = '")[1].split("'")[0]
    ok = [f"protobuf>={stamped}", f"grpcio>={grpc_stamped}"]
    setup_module.check_generated_versions(out, ok)
    with pytest.raises(setup_module.ProtoBuildError, match=r"protobuf>=.*declares protobuf>=4\.25"):
        setup_module.check_generated_versions(out, ["protobuf>=4.25", f"grpcio>={grpc_stamped}"])
    with pytest.raises(setup_module.ProtoBuildError, match=r"grpcio>=.*declares grpcio>=\(none\)"):
        setup_module.check_generated_versions(out, [f"protobuf>={stamped}", "grpcio"])
    # The floors the project declares pass (the wheel fixture's build ran the same check).
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    setup_module.check_generated_versions(out, declared)


def test_a_broken_or_missing_proto_fails_the_build(setup_module: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(setup_module.ProtoBuildError, match=r"no \.proto files"):
        setup_module.generate_protos(tmp_path / "empty", tmp_path / "out")
    broken = tmp_path / "proto" / "fs3"
    broken.mkdir(parents=True)
    (broken / "bad.proto").write_text('syntax = "proto3";\npackage fs3;\nmessage Bad { int32 x = ; }\n')
    with pytest.raises(setup_module.ProtoBuildError, match=r"protoc failed on bad\.proto"):
        setup_module.generate_protos(tmp_path / "proto", tmp_path / "out")
