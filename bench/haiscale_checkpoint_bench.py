"""haiscale.checkpoint's save and load next to the alternatives, on one fs3 cluster in one run.

The state: the wide MLP (``--width``, depth 4) and its Adam state after one step (about 270 MB at
the default width). Against it, on this machine:

* fs3 raw: one file of the same size written through the native client (32 MiB writes, ``fsync``)
  and read back — the rate a checkpoint writer can hope for (what ``make bench-file`` measures);
* haiscale to fs3: ``save`` (its training-thread stall: the host snapshot) until ``wait`` (the step
  published), then ``load_latest`` into a fresh model and optimizer;
* ``torch.save``/``torch.load`` of the same state to the fs3 FUSE mount of the same cluster and to a
  local directory (with ``fsync``), and haiscale to the same local directory;
* ``torch.distributed.checkpoint`` with its fsspec writer and reader on an ``fs3://`` URL.

fs3 runs as a local cluster (mgmtd, meta, 3 storage processes with 2 targets each, 3 replicas),
mounted as ``fs3 local up --mount`` does. Each figure is the better of ``--repeat`` runs.

Usage: ``python bench/haiscale_checkpoint_bench.py [--width 2560] [--repeat 2]``.
Writes ``bench/results/haiscale-checkpoint-<timestamp>.json``, prints one JSON line and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.results_io import save_result  # noqa: E402
from haiscale.checkpoint import CheckpointManager  # noqa: E402
from haiscale.models import wide_mlp  # noqa: E402
from tests.harness import ProcessCluster  # noqa: E402

MIB = 1 << 20
PIECE = 32 * MIB


def _state(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    model = wide_mlp(width=width, depth=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).square().mean().backward()
    opt.step()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(t.numel() * t.element_size() for s in opt.state_dict()["state"].values() for t in s.values()
                  if isinstance(t, torch.Tensor))
    return model, opt, nbytes


def _fresh(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = wide_mlp(width=width, depth=4, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).square().mean().backward()
    opt.step()
    return model, opt


def _best(repeat: int, run: Callable[[int], dict[str, float]]) -> dict[str, float]:
    """Each figure's best (lowest time) over the runs."""
    runs = [run(i) for i in range(repeat)]
    return {key: min(r[key] for r in runs) for key in runs[0]}


def _raw_fs3(fs: Any, nbytes: int, i: int) -> dict[str, float]:
    data = memoryview(os.urandom(PIECE))
    path = f"/bench/raw-{i}"
    start = time.perf_counter()
    with fs.open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(data[:min(PIECE, left)])
        f.fsync()
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    with fs.open(path, "rb", buffering=0) as f:
        buf = bytearray(PIECE)
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - start
    fs.remove(path)
    return {"save_s": write_s, "load_s": read_s}


def _haiscale(make: Callable[[str], CheckpointManager], width: int, model: torch.nn.Module,
              opt: torch.optim.Optimizer, i: int) -> dict[str, float]:
    with make(f"hs-{i}") as ckpt:
        ckpt.save(1, model, opt)  # warms the host buffers (a run saves many times)
        ckpt.wait()
        start = time.perf_counter()
        ckpt.save(2, model, opt)
        stall_s = time.perf_counter() - start
        ckpt.wait()
        save_s = time.perf_counter() - start
        fresh, fresh_opt = _fresh(width)
        start = time.perf_counter()
        loaded = ckpt.load_latest(fresh, fresh_opt)
        load_s = time.perf_counter() - start
    assert loaded is not None and loaded.step == 2
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(),
                                                 strict=True))
    return {"save_s": save_s, "load_s": load_s, "stall_s": stall_s}


def _torch_file(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> dict[str, float]:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"torch-{i}.pt"
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    torch.load(path, weights_only=True)
    load_s = time.perf_counter() - start
    path.unlink()
    return {"save_s": save_s, "load_s": load_s}


def _dcp(url: str, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> dict[str, float]:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    where = f"{url}/dcp-{i}"
    state = {"model": model.state_dict()}
    start = time.perf_counter()
    # fs3 files are durable when closed (every replica acknowledged); DCP's sync_files would fall
    # back to a machine-wide os.sync() (an fs3 file has no descriptor), timing the local disk.
    dcp_save(state, checkpoint_id=where, storage_writer=FsspecWriter(where, sync_files=False))
    save_s = time.perf_counter() - start
    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    start = time.perf_counter()
    dcp_load(target, checkpoint_id=where, storage_reader=FsspecReader(where))
    load_s = time.perf_counter() - start
    return {"save_s": save_s, "load_s": load_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model, opt, nbytes = _state(args.width)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    import fs3

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="haiscale-ckpt-bench-") as tmp:
        local = Path(tmp) / "local"
        results["torch_local"] = _best(args.repeat, lambda i: _torch_file(local, model, opt, i))
        results["haiscale_local"] = _best(args.repeat, lambda i: _haiscale(
            lambda name: CheckpointManager(local / name), args.width, model, opt, i))
        shutil.rmtree(local)
        cluster = ProcessCluster(Path(tmp) / "cluster", storage_nodes=3, targets_per_node=2)
        try:
            cluster.start_all()
            asyncio.run(cluster.ensure_chains(3))
            cluster.set_mount(Path(tmp) / "mnt")
            cluster.start("mount")
            os.environ["FS3_TOKEN_FILE"] = str(cluster.token_file)
            with fs3.connect(cluster.mgmtd_address) as fs:
                fs.makedirs("/bench", exist_ok=True)
                _raw_fs3(fs, 64 * MIB, 99)  # warm up connections and the first file creations
                results["fs3_raw"] = _best(args.repeat, lambda i: _raw_fs3(fs, nbytes, i))
                results["haiscale_fs3"] = _best(args.repeat, lambda i: _haiscale(
                    lambda name: CheckpointManager(fs=fs, directory=f"/bench/{name}"), args.width, model, opt, i))
                results["torch_fuse"] = _best(args.repeat, lambda i: _torch_file(
                    Path(tmp) / "mnt" / "bench" / "torch", model, opt, i))
                dcp = _best(args.repeat, lambda i: _dcp(f"fs3://{cluster.mgmtd_address}/bench", model, opt, i))
                # DCP saved the model only (its optimizer state needs a process group's state_dict
                # helpers): its figures are scaled to the same bytes.
                scale = nbytes / model_bytes
                results["dcp_fs3"] = {key: value * scale for key, value in dcp.items()}
        finally:
            cluster.stop_all()
            with contextlib.suppress(KeyError):
                del os.environ["FS3_TOKEN_FILE"]

    def rate(name: str, key: str) -> float:
        return nbytes / MIB / results[name][key]

    hs = results["haiscale_fs3"]
    ratios = {
        "save_vs_fs3_raw_write": rate("haiscale_fs3", "save_s") / rate("fs3_raw", "save_s"),
        "save_vs_torch_save_fuse": rate("haiscale_fs3", "save_s") / rate("torch_fuse", "save_s"),
        "save_vs_dcp_fs3": rate("haiscale_fs3", "save_s") / rate("dcp_fs3", "save_s"),
        "load_vs_torch_load_fuse": rate("haiscale_fs3", "load_s") / rate("torch_fuse", "load_s"),
        "load_vs_fs3_raw_read": rate("haiscale_fs3", "load_s") / rate("fs3_raw", "load_s"),
        "stall_fraction_of_save": hs["stall_s"] / hs["save_s"],
    }
    goals = {"save_vs_fs3_raw_write": ratios["save_vs_fs3_raw_write"] >= 0.8,
             "save_vs_torch_save_fuse": ratios["save_vs_torch_save_fuse"] >= 1.5,
             "stall_fraction_of_save": ratios["stall_fraction_of_save"] <= 0.05}
    record = {"state_mib": nbytes / MIB, "width": args.width, "repeat": args.repeat,
              "MiBps": {name: {"save": rate(name, "save_s"), "load": rate(name, "load_s")} for name in results},
              "stall_ms": hs["stall_s"] * 1e3, "stall_ms_local": results["haiscale_local"]["stall_s"] * 1e3,
              "ratios": ratios, "goals_met": goals}
    print(json.dumps(record))
    print(f"state {nbytes / MIB:.0f} MiB (wide MLP width {args.width} + Adam), best of {args.repeat}")
    print(f"{'':<16} {'save MiB/s':>11} {'load MiB/s':>11}")
    for name in results:
        print(f"{name:<16} {rate(name, 'save_s'):>11.1f} {rate(name, 'load_s'):>11.1f}")
    print(f"training-thread stall per save: {hs['stall_s'] * 1e3:.1f} ms (fs3), "
          f"{results['haiscale_local']['stall_s'] * 1e3:.1f} ms (local)")
    for name, value in ratios.items():
        goal = f"  (goal {'met' if goals[name] else 'missed'})" if name in goals else ""
        print(f"  {name}: {value:.3f}{goal}")
    print(f"wrote {save_result('haiscale-checkpoint', record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
