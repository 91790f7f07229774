"""Generates fs3's protobuf modules inside the build, so that every wheel and `pip install .` carries them.

The metadata lives in pyproject.toml; this file only adds one step to `build_py`: grpc_tools.protoc turns
proto/fs3/*.proto into fs3/*_pb2.py, fs3/*_pb2.pyi and fs3/*_pb2_grpc.py, and the .proto files are copied to
fs3/proto/fs3/ (the public gRPC contract, for code generators in other languages; docs/grpc.md). The generated
modules are never committed (they are git-ignored and `make proto` makes them for a checkout), so a build from a
clean tree or from the sdist must make them itself. A regular build writes them into the build directory only;
an editable install (`pip install -e .`) writes them next to the sources, as `make proto` does, because that is
where the editable finder looks. A regular build takes none of a checkout's own generated files (`make proto`'s,
perhaps of a .proto since renamed or removed) nor an earlier build's: the wheel holds what this build generated.

Generated code refuses to import under an older runtime than the one it was generated for (protobuf's gencode
check, grpc's GRPC_GENERATED_VERSION check), so the build also checks that the floors pyproject.toml declares for
`protobuf` and `grpcio` are at least the versions the generator stamped into the modules: a wheel that installs
cleanly but fails on `import fs3.meta_pb2` is a build error, not a user's problem (docs/decisions.md).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"
"""The -I root: proto/fs3/x.proto is imported as "fs3/x.proto", so the modules land in the fs3 package."""

_GENCODE_RE = re.compile(r"^# Protobuf Python Version: (\d+(?:\.\d+)*)", re.MULTILINE)
_GRPC_GENERATED_RE = re.compile(r"^GRPC_GENERATED_VERSION = '(\d+(?:\.\d+)*)'", re.MULTILINE)
# What generate_protos writes, relative to the fs3 package directory.
GENERATED_GLOBS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py", "proto/fs3/*.proto")


class ProtoBuildError(RuntimeError):
    """The protobuf modules could not be generated, or would not import under the declared dependencies."""


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def declared_floor(requirements: Iterable[str], name: str) -> str | None:
    """The `>=` floor of `name` among requirement strings (PEP 508), or None when it declares none."""
    for requirement in requirements:
        match = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[[^\]]*\])?([^;]*)", requirement)
        if match is None or match.group(1).lower().replace("_", "-") != name.lower():
            continue
        floor = re.search(r">=\s*(\d+(?:\.\d+)*)", match.group(2))
        return floor.group(1) if floor else None
    return None


def check_generated_versions(out_dir: Path, requirements: Iterable[str]) -> None:
    """Raise ProtoBuildError unless the declared protobuf and grpcio floors cover what the modules demand.

    `out_dir` holds the generated fs3/*_pb2*.py; `requirements` are the project's install requirements.
    """
    requirements = list(requirements)
    demands = {"protobuf": (_GENCODE_RE, "*_pb2.py"), "grpcio": (_GRPC_GENERATED_RE, "*_pb2_grpc.py")}
    for package, (pattern, glob) in demands.items():
        stamped = {m.group(1) for path in sorted((out_dir / "fs3").glob(glob))
                   if (m := pattern.search(path.read_text(encoding="utf-8")))}
        if not stamped:
            continue  # an older generator writes no version check: nothing to cover
        needed = max(stamped, key=_version_tuple)
        floor = declared_floor(requirements, package)
        if floor is None or _version_tuple(floor) < _version_tuple(needed):
            raise ProtoBuildError(
                f"the generated modules need {package}>={needed} at run time, but pyproject.toml declares "
                f"{package}>={floor or '(none)'}: raise that floor, or pin grpcio-tools in [build-system] "
                f"to the release that generates for the declared {package}")


def generate_protos(proto_root: Path, out_dir: Path) -> list[Path]:
    """Run grpc_tools.protoc on proto_root/fs3/*.proto into out_dir/fs3/, copy the .proto files to
    out_dir/fs3/proto/fs3/, and return every file written."""
    from importlib.resources import files

    from grpc_tools import protoc  # a build requirement ([build-system] in pyproject.toml)

    sources = sorted((proto_root / "fs3").glob("*.proto"))
    if not sources:
        raise ProtoBuildError(f"no .proto files under {proto_root / 'fs3'}: the sdist or checkout is incomplete")
    (out_dir / "fs3").mkdir(parents=True, exist_ok=True)
    well_known = str(files("grpc_tools") / "_proto")  # google/protobuf/descriptor.proto, imported by common.proto
    args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *(str(s) for s in sources)]
    if protoc.main(args) != 0:
        names = ", ".join(source.name for source in sources)
        raise ProtoBuildError(f"grpc_tools.protoc failed on {names} (its message is above)")
    written: list[Path] = []
    for source in sources:
        stem = source.stem
        written += [out_dir / "fs3" / f"{stem}_pb2.py", out_dir / "fs3" / f"{stem}_pb2.pyi",
                    out_dir / "fs3" / f"{stem}_pb2_grpc.py"]
        shipped = out_dir / "fs3" / "proto" / "fs3" / source.name
        shipped.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, shipped)
        written.append(shipped)
    missing = [str(path) for path in written if not path.is_file()]
    if missing:
        raise ProtoBuildError(f"grpc_tools.protoc reported success but wrote no {', '.join(missing)}")
    return written


def is_generated(package: str, relative: str) -> bool:
    """Whether `relative` (a path inside `package`'s directory) is a file generate_protos writes."""
    return package == "fs3" and any(PurePosixPath(relative).match(glob) and relative.count("/") == glob.count("/")
                                    for glob in GENERATED_GLOBS)


def remove_generated(out_dir: Path) -> None:
    """Delete every file generate_protos writes from out_dir/fs3/ (stale ones among them)."""
    for glob in GENERATED_GLOBS:
        for path in (out_dir / "fs3").glob(glob):
            path.unlink()


class BuildPyWithProtos(build_py):  # type: ignore[misc]  # setuptools ships no type information
    """`build_py` that also generates the protobuf modules (see the module docstring)."""

    def run(self) -> None:
        super().run()
        out_dir = ROOT if self.editable_mode else Path(self.build_lib)
        if not self.editable_mode:
            remove_generated(out_dir)  # an earlier build's, perhaps of a .proto removed since
        self._generated = generate_protos(PROTO_ROOT, out_dir)
        check_generated_versions(out_dir, self.distribution.install_requires or [])

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules: list[tuple[str, str, str]] = super().find_package_modules(package, package_dir)
        if self.editable_mode:
            return modules
        return [m for m in modules if not is_generated(package, os.path.relpath(m[2], package_dir))]

    def find_data_files(self, package: str, src_dir: str) -> list[str]:
        files: list[str] = super().find_data_files(package, src_dir)
        if self.editable_mode:
            return files
        return [f for f in files if not is_generated(package, Path(os.path.relpath(f, src_dir)).as_posix())]

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs: list[str] = list(super().get_outputs(include_bytecode))
        return outputs + [str(path) for path in getattr(self, "_generated", []) if str(path) not in outputs]


if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildPyWithProtos})
