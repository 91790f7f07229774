"""Train the byte-level GPT on records read from fs3, data-, fully-sharded- or pipeline-parallel,
checkpointing to fs3 — the whole HaiScale stack in one program::

    python -m haiscale.data convert /usr/lib/python3.11 fs3:///datasets/pystdlib --text --record-bytes 65
    torchrun --nproc-per-node 4 -m haiscale.examples.train_gpt --mode ddp \\
        --data fs3:///datasets/pystdlib --ckpt fs3:///ckpt/gpt --steps 200

Every mode trains on the same global batches: each data-parallel rank draws its ``B/R`` records of
a step from :class:`~haiscale.data.DistributedRecordSampler`, which hands rank ``r`` of ``R`` every
``R``-th record of the (seed, epoch) permutation — so together the ranks read records
``perm[s*B:(s+1)*B]`` at step ``s``, whatever ``R`` is, and any layout's run can be checked against
one process's (``--mode single``). A resumed run continues from the checkpoint's step with the same
batches (the sampler's position is in the checkpoint), parameters and optimizer state, bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import torch

import haiscale
from haiscale.models import ByteGPT, GPTConfig, lm_loss

MODES = ("single", "ddp", "fsdp", "pipeline")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m haiscale.examples.train_gpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, default="ddp")
    parser.add_argument("--data", required=True, help="records (fs3:// URL or local directory) of block+1 bytes each")
    parser.add_argument("--ckpt", help="checkpoint directory (fs3:// URL or local); resumes from its latest")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, in records")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--pipeline-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--placement", choices=("contiguous", "staggered"), default="contiguous")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--out", help="where to write the final parameters (torch.save of a name -> tensor dict)")
    parser.add_argument("--die-after-step", type=int, default=-1, help="(fault drills) SIGKILL this rank after step N")
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--check-replicas", action="store_true",
                        help="(DDP diagnostics) after every backward and optimizer step, check that every rank holds "
                             "dp rank 0's gradients, parameters and optimizer state, bit for bit")
    args = parser.parse_args(argv)
    if args.steps < 0 or args.batch_size < 1:
        parser.error("--steps must be >= 0 and --batch-size >= 1")
    return args


class Trainer:
    def __init__(self, args: argparse.Namespace) -> None:
        from haiscale.data import DistributedRecordSampler, RecordDataset

        self.args = args
        self.dataset = RecordDataset(args.data)
        config = GPTConfig(block_size=len(self.dataset[0]) - 1, n_layer=args.layers, n_head=args.heads,
                           n_embd=args.embd)
        self.config = config
        self.ctx: haiscale.ParallelContext | None = None
        if args.mode != "single":
            self.ctx = haiscale.init(pipeline_size=args.pipeline_size if args.mode == "pipeline" else 1,
                                     placement=args.placement, timeout_s=args.timeout_s)
        self.rank = self.ctx.rank if self.ctx else 0
        self.dp_rank = self.ctx.dp_rank if self.ctx else 0
        self.dp_size = self.ctx.data_size if self.ctx else 1
        if args.batch_size % self.dp_size:
            raise SystemExit(f"--batch-size {args.batch_size} is not a multiple of the {self.dp_size} "
                             f"data-parallel ranks")
        if len(self.dataset) < args.batch_size:
            raise SystemExit(f"{len(self.dataset)} records do not fill one global batch of {args.batch_size}")
        self.share = args.batch_size // self.dp_size
        self.sampler = DistributedRecordSampler(len(self.dataset), num_replicas=self.dp_size, rank=self.dp_rank,
                                                seed=args.seed)
        self.epoch = 0
        self.steps_done = 0
        self.sampler.set_epoch(0)
        self._indices = iter(self.sampler)
        model = ByteGPT(config, seed=args.seed)
        self.model: Any
        self.pipeline: Any = None
        if args.mode == "single":
            self.model = model
        elif args.mode == "ddp":
            from haiscale.ddp import DistributedDataParallel

            self.model = DistributedDataParallel(model)
        elif args.mode == "fsdp":
            from haiscale.fsdp import FullyShardedDataParallel
            from haiscale.models import Block, Embedding, Head

            self.model = FullyShardedDataParallel(model, wrap=(Embedding, Block, Head))
        else:
            from haiscale.pipeline import PipelineParallel

            assert self.ctx is not None
            stage = model.stages(self.ctx.pipeline_size)[self.ctx.stage]
            self.model = stage
            self.pipeline = PipelineParallel(stage, loss_fn=lm_loss, micro_batches=args.micro_batches,
                                             schedule=args.schedule)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.checkpoints: Any = None
        if args.ckpt:
            from haiscale.checkpoint import CheckpointManager

            # Replicated state (DDP's model, a pipeline stage's) is written once, by the stage's first
            # data-parallel rank; FSDP's shards by every rank.
            replica_of = None
            if self.ctx is not None and args.mode != "fsdp" and self.ctx.dp_rank != 0:
                replica_of = self.ctx.layout.rank_of(self.ctx.stage, 0)
            self.checkpoints = CheckpointManager(args.ckpt, keep=args.keep, rank=self.rank,
                                                 world_size=self.ctx.world_size if self.ctx else 1,
                                                 replica_of=replica_of)
        # What the checkpoints save of the optimizer: FSDP's sharded state reshards on load.
        self.optimizer_state: Any = self.model.sharded_optimizer(self.optimizer) if args.mode == "fsdp" \
            else self.optimizer

    def next_indices(self) -> list[int]:
        """This data-parallel rank's records for the next step; an epoch's tail shorter than a batch
        is dropped (on every rank alike: each has the same number of records per epoch)."""
        while True:
            indices = [index for _, index in zip(range(self.share), self._indices, strict=False)]
            if len(indices) == self.share:
                return indices
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self._indices = iter(self.sampler)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets of this rank's share of the next global batch."""
        records = self.dataset.batch_tensor(self.next_indices()).long()
        return records[:, :-1], records[:, 1:]

    def train_step(self) -> float | None:
        inputs, targets = self.batch()
        self.optimizer.zero_grad(set_to_none=False)
        if self.pipeline is not None:
            loss = self.pipeline.train_step(inputs, targets)
            value = float(loss) if loss is not None else None  # the loss is known on the last stage only
        else:
            loss = lm_loss(self.model(inputs), targets)
            torch.autograd.backward(loss)
            value = float(loss.detach())
        if self.args.check_replicas:
            named = self.named_parameters()
            self.check_replicas("backward", {**dict(named), **{f"{name}.grad": param.grad for name, param in named
                                                               if param.grad is not None}})
        self.optimizer.step()
        if self.args.check_replicas:
            state = {f"{name}.{key}": value for name, param in self.named_parameters()
                     for key, value in self.optimizer.state.get(param, {}).items() if isinstance(value, torch.Tensor)}
            self.check_replicas("optimizer step", {**dict(self.named_parameters()), **state})
        self.steps_done += 1
        return value

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        module = self.model.module if self.args.mode == "ddp" else self.model
        return list(module.named_parameters())

    def check_replicas(self, phase: str, tensors: dict[str, torch.Tensor]) -> None:
        """``--check-replicas`` (DDP): every rank holds dp rank 0's bytes of ``tensors``, or every rank
        raises naming the step, the phase, and each differing tensor with its largest difference from
        dp rank 0's. Collective: two small allreduces (and a broadcast per differing tensor)."""
        import hfreduce

        if self.ctx is None or self.args.mode != "ddp":
            return
        comm = self.ctx.dp_comm
        names = sorted(tensors)
        flat = {name: tensors[name].detach().reshape(-1).contiguous() for name in names}
        digests = [int.from_bytes(hashlib.blake2b(flat[name].view(torch.uint8).numpy().tobytes(),
                                                  digest_size=7).digest(), "big") for name in names]
        both = torch.tensor(digests + [-digest for digest in digests], dtype=torch.int64)
        comm.allreduce(both, op=hfreduce.ReduceOp.MAX)
        highest, lowest = both[:len(names)].tolist(), [-value for value in both[len(names):].tolist()]
        differing = [name for name, high, low in zip(names, highest, lowest, strict=True) if high != low]
        if not differing:
            return
        details = []
        for name in differing:
            reference = flat[name].clone()
            comm.broadcast(reference, src=0)
            gap = float((flat[name].double() - reference.double()).abs().max())
            details.append(f"{name} (largest difference from dp rank 0's: {gap:.3g})")
        raise RuntimeError(f"DDP replicas differ after step {self.steps_done + 1}'s {phase} (dp rank "
                           f"{self.dp_rank}): {', '.join(details)}")

    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters as one process holds them (this stage's, for a pipeline)."""
        if self.args.mode == "fsdp":
            return {k: v.clone() for k, v in self.model.full_state_dict().items()}
        module = self.model.module if self.args.mode == "ddp" else self.model
        names = {id(p): n for n, p in module.named_parameters()}
        if self.args.mode == "pipeline":
            assert self.ctx is not None
            # Name a stage's parameters as the whole model names them, so stages can be merged.
            full = ByteGPT(self.config, seed=self.args.seed)
            offset = sum(len(s) for s in full.stages(self.ctx.pipeline_size)[:self.ctx.stage])
            out = {}
            for name, param in module.named_parameters():
                index, rest = name.split(".", 1)
                out[f"layers.{int(index) + offset}.{rest}"] = param.detach().clone()
            return out
        return {names[id(p)]: p.detach().clone() for p in module.parameters()}

    def layout(self) -> str:
        """How this run's checkpoints hold the model: one process's ``state_dict`` (``single`` and
        ``ddp`` write the same), FSDP's Shards (any number of ranks), or one pipeline stage per rank
        (only the same pipeline size reads them back). Two runs resume each other's checkpoints only
        when this is the same: otherwise the state would load as garbage or fail deep in the loader."""
        if self.args.mode in ("single", "ddp"):
            return "replicated"
        if self.args.mode == "fsdp":
            return "sharded"
        return f"pipeline of {self.args.pipeline_size} stages"

    def position(self) -> dict[str, Any]:
        """Where the data stands, for a checkpoint: a resumed run reads exactly the next records (and
        how the model is stored, checked before a resume loads anything)."""
        return {"sampler": self.sampler.state_dict(), "layout": self.layout(), "mode": self.args.mode}

    def check_resumable(self) -> None:
        """Refuse, before any state is loaded, a checkpoint written in another layout (``--mode`` or
        ``--pipeline-size``): loading only the extra state reads no model or optimizer."""
        assert self.checkpoints is not None
        peek = self.checkpoints.load_latest()
        if peek is None or not isinstance(peek.extra, dict) or "layout" not in peek.extra:
            return
        if peek.extra["layout"] != self.layout():
            raise SystemExit(f"the checkpoint {peek.path} was written by --mode {peek.extra.get('mode')} "
                             f"({peek.extra['layout']}); this run is --mode {self.args.mode} ({self.layout()}): "
                             f"resume it with the mode (and pipeline size) it was written with")

    def restore_position(self, extra: dict[str, Any]) -> None:
        self.sampler.load_state_dict(extra["sampler"])
        self.epoch = self.sampler.epoch
        self._indices = iter(self.sampler)

    def run(self) -> dict[str, Any]:
        start_step = 0
        if self.checkpoints is not None:
            self.check_resumable()
            loaded = self.checkpoints.load_latest(self.model, self.optimizer_state)
            if loaded is not None:
                start_step = self.steps_done = int(loaded.step)
                self.restore_position(loaded.extra)
        losses: list[float | None] = []
        started = time.monotonic()
        try:
            for step in range(start_step, self.args.steps):
                losses.append(self.train_step())
                done = step + 1
                if self.checkpoints is not None and self.args.save_every and done % self.args.save_every == 0:
                    self.checkpoints.save(done, self.model, self.optimizer_state, extra=self.position())
                if step == self.args.die_after_step and self.rank == self.args.die_rank:
                    if self.checkpoints is not None:
                        self.checkpoints.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
        finally:
            # Even when training fails (a dead peer), a save already snapshotted is finished and
            # published: its data is whole, and it is what a relaunch resumes from.
            if self.checkpoints is not None:
                self.checkpoints.close()
        params = self.parameters_by_name()
        if self.args.out and self.dp_rank == 0:
            stage = self.ctx.stage if self.ctx is not None and self.args.mode == "pipeline" else None
            torch.save(params, self.args.out if stage is None else f"{self.args.out}.stage{stage}")
        return {"rank": self.rank, "start_step": start_step, "steps": self.args.steps, "losses": losses,
                "seconds": time.monotonic() - started, "params_sha256": params_digest(params)}


def params_digest(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the parameters' names and bytes: the replicas of a data-parallel group (DDP's ranks,
    a pipeline stage's) must report the same digest, bit for bit."""
    digest = hashlib.sha256()
    for name in sorted(params):
        tensor = params[name].detach().contiguous()
        digest.update(name.encode() + b"\0" + str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trainer = Trainer(args)
    try:
        result = trainer.run()
        print(json.dumps(result), flush=True)
        return 0
    finally:
        trainer.dataset.close()
        if trainer.ctx is not None:
            haiscale.destroy()


if __name__ == "__main__":
    sys.exit(main())
