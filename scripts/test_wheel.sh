#!/usr/bin/env bash
# make test-wheel: the wheel as a user gets it. Builds the sdist and a wheel from it with `python -m build`
# (from a copy of the source tree without generated protobuf modules), installs the wheel into a fresh venv
# with its dependencies from the package index (pip's cache makes reruns quick), and from a directory outside
# the repository, with no PYTHONPATH: `fs3 local up`, a file written and read with the Python client,
# `fs3 local down`; then the same with a FUSE mount (the `fuse` extra; skipped, and said so, when libfuse3's
# headers or /dev/fuse are missing), the file read back through the mount and one written there read with the
# client. Checks that nothing installed points into the source tree. Everything lives under one temporary
# directory, removed at the end; a failure stops the cluster and unmounts first.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/fs3-wheel.XXXXXX)
VENV=$WORK/venv
CLUSTER=$WORK/cluster
MNT=$WORK/mnt
started=$(date +%s)

cleanup() {
    local status=$?
    if [ -x "$VENV/bin/fs3" ] && [ -d "$CLUSTER" ]; then
        (cd "$WORK" && env -u PYTHONPATH FS3_CONFIG="$WORK/config.toml" "$VENV/bin/fs3" local down --dir "$CLUSTER") \
            >/dev/null 2>&1 || true
    fi
    if mountpoint -q "$MNT" 2>/dev/null; then fusermount3 -u "$MNT" 2>/dev/null || umount -l "$MNT" || true; fi
    rm -rf "$WORK"
    if [ "$status" = 0 ]; then
        echo "test-wheel: passed in $(( $(date +%s) - started )) s"
    else
        echo "test-wheel: FAILED (exit $status) after $(( $(date +%s) - started )) s" >&2
    fi
}
trap cleanup EXIT

step() { echo "test-wheel: $*"; }

step "copying the source tree (tracked and new files; no generated modules) to $WORK/src"
mkdir -p "$WORK/src"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard) \
    | (cd "$REPO" && xargs -0 sh -c 'for f; do [ -f "$f" ] && printf "%s\0" "$f"; done' sh) \
    | (cd "$REPO" && xargs -0 cp --parents -t "$WORK/src")
if ls "$WORK/src"/fs3/*_pb2*.py >/dev/null 2>&1; then echo "test-wheel: generated modules in the copy" >&2; exit 1; fi

step "fresh venv $VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q build >"$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log" >&2; exit 1; }

step "python -m build: sdist, then the wheel from the sdist"
"$VENV/bin/python" -m build -q --outdir "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log" >&2; exit 1; }
WHEEL=$(ls "$WORK"/dist/fs3-*.whl)
SDIST=$(ls "$WORK"/dist/fs3-*.tar.gz)
if tar -tzf "$SDIST" | grep -E '_pb2(_grpc)?\.pyi?$|/tests/|/bench/'; then
    echo "test-wheel: the sdist carries generated modules, tests or benchmarks (above)" >&2; exit 1
fi

# The train extra (numpy, torch) so that hfreduce and haiscale import too; constraints.txt pins torch.
extras="train"
if [ -f /usr/include/fuse3/fuse_lowlevel.h ] && [ -c /dev/fuse ] && command -v fusermount3 >/dev/null; then
    extras="fuse,$extras"
else
    step "no libfuse3 headers, /dev/fuse or fusermount3: the mount part is skipped"
fi
step "pip install $(basename "$WHEEL")[$extras] (dependencies from the package index)"
"$VENV/bin/python" -m pip install -q -c "$REPO/constraints.txt" "$WHEEL[$extras]" >"$WORK/pip.log" 2>&1 \
    || { cat "$WORK/pip.log" >&2; exit 1; }

# From here on: outside the repository, no PYTHONPATH, only the venv's commands.
mkdir -p "$WORK/run"
cd "$WORK/run"
unset PYTHONPATH
export FS3_CONFIG=$WORK/config.toml
export PATH=$VENV/bin:$PATH

step "nothing installed points into the source tree"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$VENV/bin/python" - "$SITE" "$REPO" <<'EOF'
import sys
from pathlib import Path

import fs3, fs3.meta_pb2_grpc, hai, haiscale, hfreduce, cluster_model  # noqa: E401  every package imports

site, repo = Path(sys.argv[1]), sys.argv[2]
for module in (fs3, fs3.meta_pb2_grpc, hai, haiscale, hfreduce, cluster_model):
    assert Path(module.__file__).is_relative_to(site), (module.__name__, module.__file__)
assert not any(p.startswith(repo) for p in sys.path), sys.path
hits = [str(path) for path in site.rglob("*") if path.is_file() and path.suffix in (".py", ".pth", ".txt", ".json")
        and repo.encode() in path.read_bytes()]
assert not hits, f"installed files naming {repo}: {hits}"
EOF
fs3 --help >/dev/null && hai --help >/dev/null  # both console scripts start
head -1 "$VENV/bin/fs3" | grep -q "^#!$VENV/bin/python" || { echo "test-wheel: fs3 is not the venv's script" >&2; exit 1; }

client_roundtrip() {  # write a file with the client and read it back; $1 names it
    "$VENV/bin/python" - "$1" <<'EOF'
import os, sys

import fs3

name = sys.argv[1]
data = os.urandom(3 << 20)
fs = fs3.connect(profile="wheel")
fs.makedirs("/wheel", exist_ok=True)
with fs.open(f"/wheel/{name}", "wb") as f:
    f.write(data)
with fs.open(f"/wheel/{name}", "rb") as f:
    assert f.read() == data, "read back differs"
print(f"client: /wheel/{name} {len(data)} bytes written and read back")
EOF
}

step "fs3 local up (no mount)"
fs3 local up --dir "$CLUSTER" --detach --profile wheel
client_roundtrip plain.bin
fs3 local down --dir "$CLUSTER"

if [[ $extras == fuse* ]]; then
    step "fs3 local up --mount $MNT"
    mkdir -p "$MNT"
    fs3 local up --dir "$CLUSTER" --detach --profile wheel --mount "$MNT"
    mountpoint -q "$MNT" || { echo "test-wheel: $MNT is not mounted" >&2; exit 1; }
    client_roundtrip mounted.bin
    test "$(stat -c %s "$MNT/wheel/mounted.bin")" = $((3 << 20))
    test "$(stat -c %s "$MNT/wheel/plain.bin")" = $((3 << 20))  # written before the restart
    head -c 1048576 /dev/urandom > "$WORK/local.bin"
    cp "$WORK/local.bin" "$MNT/wheel/through-mount.bin"
    cmp "$WORK/local.bin" "$MNT/wheel/through-mount.bin"
    "$VENV/bin/python" - "$WORK/local.bin" <<'EOF'
import sys

import fs3

want = open(sys.argv[1], "rb").read()
assert fs3.connect(profile="wheel").read_bytes("/wheel/through-mount.bin") == want, "mount and client disagree"
print("client: the file written through the mount reads back the same")
EOF
    fs3 local down --dir "$CLUSTER"
    if mountpoint -q "$MNT"; then echo "test-wheel: $MNT still mounted after fs3 local down" >&2; exit 1; fi
fi
