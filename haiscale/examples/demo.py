"""``make train-demo``: the whole training path on a local fs3 cluster, end to end.

1. starts ``fs3 local up`` in a scratch directory (a profile in a private config file, so nothing
   of the user's changes);
2. converts the Python standard library's own source files into records on fs3 (real text that
   exists on every machine, no download);
3. trains the byte-level GPT with HaiScale DDP on 4 ranks, reading batches from fs3 and
   checkpointing to fs3 every ``--save-every`` steps; one rank is killed with SIGKILL part way, the
   job fails, and a relaunch resumes from the latest checkpoint;
4. repeats the run without the kill and checks that the two end bit-identical;
5. prints the loss curve and a few bytes the trained model writes.

Usage: ``python -m haiscale.examples.demo [--steps 300] [--ranks 4] [--keep-cluster]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

PROFILE = "haiscale-demo"
RECORD_BYTES = 129  # block size 128 + the next byte


def corpus(into: Path, limit_bytes: int) -> int:
    """The standard library's top-level ``.py`` files (sorted, up to ``limit_bytes``) copied into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    total = 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total >= limit_bytes:
            break
        shutil.copy(source, into / source.name)
        total += source.stat().st_size
    return total


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def train(env: dict[str, str], ranks: int, args: list[str], log_dir: Path, name: str) -> list[tuple[int, str]]:
    """``ranks`` processes of ``haiscale.examples.train_gpt``; each rank's exit status and output."""
    port = free_port()
    procs = []
    for rank in range(ranks):
        log = log_dir / f"{name}-{rank}.log"
        # One compute thread per rank, as torchrun starts them: ranks x torch's default threads would
        # oversubscribe the cores many times over.
        rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
        with log.open("w") as out:
            procs.append((subprocess.Popen([sys.executable, "-m", "haiscale.examples.train_gpt", *args], env=rank_env,
                                           stdout=out, stderr=subprocess.STDOUT), log))
    return [(proc.wait(), log.read_text()) for proc, log in procs]


def last_json(text: str) -> dict[str, Any]:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"a rank printed no result:\n{text[-2000:]}")
    return dict(json.loads(lines[-1]))


def sample(params_path: Path, prompt: bytes, count: int, model_args: dict[str, int]) -> bytes:
    """Greedy continuation of ``prompt`` by the trained model."""
    import torch

    from haiscale.models import ByteGPT, GPTConfig

    config = GPTConfig(block_size=RECORD_BYTES - 1, **model_args)
    model = ByteGPT(config)
    model.load_state_dict(torch.load(params_path, weights_only=True))
    model.eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            window = torch.tensor([tokens[-config.block_size:]])
            tokens.append(int(model(window)[0, -1].argmax()))
    return bytes(tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m haiscale.examples.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--corpus-mib", type=int, default=8)
    parser.add_argument("--keep-cluster", action="store_true", help="leave the cluster and its directory in place")
    args = parser.parse_args(argv)
    kill_after = args.steps * 2 // 3
    model_args = {"n_layer": 4, "n_head": 4, "n_embd": 128}
    root = Path(tempfile.mkdtemp(prefix="haiscale-demo-"))
    env = {**os.environ, "FS3_CONFIG": str(root / "config.toml"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    fs3 = [sys.executable, "-m", "fs3.cli.main"]
    started = time.monotonic()
    try:
        print(f"starting a local fs3 cluster in {root / 'cluster'}", flush=True)
        subprocess.run([*fs3, "local", "up", "--dir", str(root / "cluster"), "--detach", "--profile", PROFILE],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        size = corpus(root / "corpus", args.corpus_mib << 20)
        data = f"fs3://{PROFILE}@/datasets/pystdlib"
        subprocess.run([sys.executable, "-m", "haiscale.data", "convert", str(root / "corpus"), data, "--text",
                        "--record-bytes", str(RECORD_BYTES), "--stride", str(RECORD_BYTES - 1),
                        "--records-per-file", "8192"], env=env, check=True)
        print(f"corpus: {size / 2**20:.1f} MiB of the standard library's source, as records on {data}", flush=True)
        common = ["--mode", "ddp", "--data", data, "--steps", str(args.steps), "--batch-size", "32",
                  "--layers", str(model_args["n_layer"]), "--heads", str(model_args["n_head"]),
                  "--embd", str(model_args["n_embd"]), "--save-every", str(args.save_every), "--timeout-s", "20"]
        checkpoint = f"fs3://{PROFILE}@/checkpoints/demo"
        print(f"training on {args.ranks} ranks; rank {args.ranks - 1} is killed after step {kill_after + 1}",
              flush=True)
        killed = train(env, args.ranks, [*common, "--ckpt", checkpoint, "--die-after-step", str(kill_after),
                                         "--die-rank", str(args.ranks - 1)], root, "killed")
        codes = [code for code, _ in killed]
        print(f"  the job failed as it should: exit statuses {codes}", flush=True)
        resumed = train(env, args.ranks, [*common, "--ckpt", checkpoint, "--out", str(root / "resumed.pt")],
                        root, "resumed")
        if any(code for code, _ in resumed):
            raise SystemExit("the relaunch failed:\n" + "\n".join(text[-2000:] for _, text in resumed))
        start = last_json(resumed[0][1])["start_step"]
        print(f"  relaunched: resumed from the checkpoint of step {start} and finished", flush=True)
        print("training again without the kill, for comparison", flush=True)
        straight = train(env, args.ranks, [*common, "--out", str(root / "straight.pt")], root, "straight")
        if any(code for code, _ in straight):
            raise SystemExit("the uninterrupted run failed:\n" + "\n".join(text[-2000:] for _, text in straight))
        import torch

        a, b = torch.load(root / "resumed.pt", weights_only=True), torch.load(root / "straight.pt", weights_only=True)
        identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        losses = last_json(straight[0][1])["losses"]
        marks = sorted({0, len(losses) // 4, len(losses) // 2, 3 * len(losses) // 4, len(losses) - 1})
        print("loss (rank 0's share of each batch): " + ", ".join(f"step {i + 1}: {losses[i]:.3f}" for i in marks))
        print(f"resumed run bit-identical to the uninterrupted one: {identical}")
        text = sample(root / "straight.pt", b"def ", 120, model_args)
        print("the model writes: " + text.decode("utf-8", "replace"))
        print(f"demo took {time.monotonic() - started:.0f} s")
        return 0 if identical else 1
    finally:
        if not args.keep_cluster:
            subprocess.run([*fs3, "local", "down", "--dir", str(root / "cluster")], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"cluster left running in {root / 'cluster'} (profile {PROFILE} in {root / 'config.toml'})")


if __name__ == "__main__":
    sys.exit(main())
