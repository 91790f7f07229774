"""Step time of data-parallel, fully-sharded and pipeline-parallel training on a node design.

Compute comes from FLOPs: ``3 x forward FLOPs`` per sample (backward costs two forwards) at the
node's measured GEMM rate (Table II) times ``mfu``, the fraction of it a whole model achieves — an
assumption per model, stated in :data:`MODELS`. Communication comes from :mod:`collectives`.

How communication meets computation is the mechanism that separates the libraries:

* **HFReduce** runs on the CPU and the NIC and needs no GPU streaming multiprocessors, so a
  gradient bucket's allreduce overlaps the rest of the backward pass; what is left exposed is
  whatever the allreduce takes beyond the backward pass, plus the last bucket.
* **NCCL** (torch DDP) reduces with GPU kernels that compete with the backward pass for SMs and
  memory bandwidth; on the PCIe node this model takes the overlap as lost (compute + allreduce).
* **FSDP** gathers each layer's parameters before its forward and backward, and reduce-scatters
  its gradients after: three passes over the parameters per step, overlapped with compute layer
  by layer (HaiScale's FSDP on HFReduce), exposing the first layer's gather; torch FSDP on NCCL
  is taken not to overlap, as for DDP.
* **Pipeline** parallelism with ``stages`` and ``micro_batches`` idles ``(stages-1)/(micro+stages-1)``
  of the time (1F1B); each stage's data-parallel allreduce runs after its last backward. With the
  staggered placement, a node holds one GPU of each of eight stages, whose allreduces fall at
  different times and take the NIC in turn; without it, a node's eight GPUs are one stage and
  their allreduces share the NIC at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cluster_model.collectives import Collective
from cluster_model.config import ConfigError
from cluster_model.node import Node

__all__ = ["MODELS", "ModelSpec", "StepTime", "TrainingJob"]


@dataclass(frozen=True)
class ModelSpec:
    """A model as the step-time model sees it. ``fwd_flops_per_sample`` in FLOP."""

    name: str
    params: float
    fwd_flops_per_sample: float
    samples_per_gpu: int            # micro-batch per GPU (data parallel: per step)
    mfu: float                      # achieved fraction of the GEMM rate (assumption)
    precision: str = "tf32"         # "tf32" or "fp16"
    grad_bytes_per_param: int = 4
    layers: int = 1
    activation_bytes_per_sample: float = 0.0   # passed between pipeline stages

    def __post_init__(self) -> None:
        if self.params <= 0 or self.fwd_flops_per_sample <= 0:
            raise ConfigError(f"model.{self.name}", "parameters and FLOPs must be positive")
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"model.{self.name}.mfu", f"must be in (0, 1], not {self.mfu}")
        if self.samples_per_gpu <= 0:
            raise ConfigError(f"model.{self.name}.samples_per_gpu", f"must be positive, not {self.samples_per_gpu}")


def _transformer(name: str, params: float, layers: int, hidden: int, seq: int, samples: int, mfu: float,
                 active_params: float | None = None) -> ModelSpec:
    # 2 FLOPs per (active) parameter per token, plus attention scores: 2 * layers * seq * hidden per token.
    per_token = 2 * (active_params or params) + 2 * layers * seq * hidden
    return ModelSpec(name, params, per_token * seq, samples, mfu, "fp16", 2, layers, seq * hidden * 2)


#: The paper's four models. Parameter counts and shapes are the public ones; micro-batches and
#: achieved fractions of the GEMM rate (mfu) are assumptions of this model, typical of A100 runs.
MODELS: dict[str, ModelSpec] = {
    # 138M parameters, 15.5 GFLOP per 224x224 image; fp32 gradients, TF32 math.
    "vgg16": ModelSpec("vgg16", 138.36e6, 15.47e9, samples_per_gpu=128, mfu=0.5, precision="tf32",
                       grad_bytes_per_param=4, layers=16),
    "gpt2-medium": _transformer("gpt2-medium", 354.8e6, 24, 1024, 1024, samples=8, mfu=0.4),
    "llama-13b": _transformer("llama-13b", 13.0e9, 40, 5120, 2048, samples=1, mfu=0.4),
    # 16.4B parameters of which 2.8B are active per token.
    "deepseekmoe-16b": _transformer("deepseekmoe-16b", 16.4e9, 28, 2048, 4096, samples=1, mfu=0.3,
                                    active_params=2.8e9),
}


@dataclass(frozen=True)
class StepTime:
    """One training step: GPU compute, communication left exposed, and pipeline bubble (seconds)."""

    compute_s: float
    exposed_comm_s: float
    bubble_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.bubble_s


@dataclass(frozen=True)
class TrainingJob:
    """A model trained on ``gpus`` GPUs of one node design with one strategy and library."""

    model: ModelSpec
    node: Node
    gpus: int
    strategy: str = "dp"                  # "dp", "fsdp" or "pp"
    library: str = "hfreduce"             # "hfreduce" or "nccl"
    stages: int = 1                       # pipeline stages (strategy "pp")
    micro_batches: int = 1                # per pipeline step
    staggered: bool = True                # staggered DP-rank placement (strategy "pp")
    nvlink: bool = False                  # HFReduce with NVLink
    bucket_bytes: int = 25 << 20          # DDP gradient bucket (torch default)
    cross_zone_gbs: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus <= 0:
            raise ConfigError("training.gpus", f"must be a positive whole number, not {self.gpus!r}")
        if self.strategy not in ("dp", "fsdp", "pp"):
            raise ConfigError("training.strategy", f"must be dp, fsdp or pp, not {self.strategy!r}")
        if self.library not in ("hfreduce", "nccl"):
            raise ConfigError("training.library", f"must be hfreduce or nccl, not {self.library!r}")
        if self.strategy == "pp" and (self.stages < 2 or self.gpus % self.stages):
            raise ConfigError("training.stages", f"{self.stages} stages do not divide {self.gpus} GPUs")
        if self.micro_batches <= 0:
            raise ConfigError("training.micro_batches", f"must be positive, not {self.micro_batches}")

    # -- pieces --------------------------------------------------------------------------------

    @property
    def _tflops(self) -> float:
        return self.node.fp16_tflops if self.model.precision == "fp16" else self.node.tf32_tflops

    def _compute_s(self, samples: float, fraction: float = 1.0) -> float:
        return 3 * self.model.fwd_flops_per_sample * samples * fraction / (self._tflops * 1e12 * self.model.mfu)

    def _allreduce_s(self, gpus: int, nbytes: float) -> float:
        if gpus <= 1 or nbytes <= 0:
            return 0.0
        collective = Collective(self.node)
        if self.library == "hfreduce":
            return collective.hfreduce(gpus, int(nbytes), self.nvlink, self.cross_zone_gbs).time_s
        return collective.nccl(gpus, int(nbytes), self.cross_zone_gbs).time_s

    # -- strategies ----------------------------------------------------------------------------

    def step(self) -> StepTime:
        if self.strategy == "dp":
            return self._data_parallel()
        if self.strategy == "fsdp":
            return self._fully_sharded()
        return self._pipeline()

    def _data_parallel(self) -> StepTime:
        compute = self._compute_s(self.model.samples_per_gpu)
        grads = self.model.params * self.model.grad_bytes_per_param
        allreduce = self._allreduce_s(self.gpus, grads)
        if self.library == "nccl":
            return StepTime(compute, allreduce)
        backward = compute * 2 / 3
        last_bucket = self._allreduce_s(self.gpus, min(self.bucket_bytes, grads))
        return StepTime(compute, max(0.0, allreduce - backward) + last_bucket)

    def _fully_sharded(self) -> StepTime:
        compute = self._compute_s(self.model.samples_per_gpu)
        # All-gather (forward), all-gather (backward), reduce-scatter: each moves half an
        # allreduce's bytes, so together 1.5 allreduces of the parameters.
        shard_bytes = self.model.params * self.model.grad_bytes_per_param
        comm = 1.5 * self._allreduce_s(self.gpus, shard_bytes)
        if self.library == "nccl":
            return StepTime(compute, comm)  # as for DDP: NCCL's kernels do not overlap on this node
        first_layer = comm / max(1, self.model.layers) / 3
        return StepTime(compute, max(0.0, comm - compute) + first_layer)

    def _pipeline(self) -> StepTime:
        stages, micro = self.stages, self.micro_batches
        per_micro = self._compute_s(self.model.samples_per_gpu, 1 / stages)
        compute = per_micro * micro
        bubble = per_micro * (stages - 1)
        dp = self.gpus // stages
        if dp == 1:
            return StepTime(compute, 0.0, bubble)
        # A stage's data-parallel group has one GPU on each of ``dp`` nodes; a node holds one GPU
        # of each of its stages.
        stage_grads = self.model.params * self.model.grad_bytes_per_param / stages
        collective = Collective(self.node)
        if self.library == "hfreduce":
            one = collective.hfreduce(dp, int(stage_grads), cross_zone_gbs=self.cross_zone_gbs,
                                      gpus_per_node=1).time_s
        else:
            one = collective.nccl(dp * self.node.gpus, int(stage_grads), self.cross_zone_gbs).time_s
        stages_per_node = min(self.node.gpus, stages)
        # Staggered: stages finish their backward one after another and take the NIC in turn, so
        # only the last one's allreduce is exposed. Otherwise all of a node's stages reduce at
        # once and share its NIC.
        exposed = one if self.staggered else one * stages_per_node
        return StepTime(compute, exposed, bubble)

    # -- scaling -------------------------------------------------------------------------------

    def samples_per_s(self) -> float:
        per_step = self.model.samples_per_gpu * (self.gpus if self.strategy != "pp" else self.gpus // self.stages
                                                 * self.micro_batches)
        return per_step / self.step().total_s


def weak_scaling_efficiency(job: TrainingJob, baseline_gpus: int) -> float:
    """Throughput per GPU at ``job.gpus`` over throughput per GPU at ``baseline_gpus`` (same per-GPU batch)."""
    base = replace(job, gpus=baseline_gpus)
    return (job.samples_per_s() / job.gpus) / (base.samples_per_s() / baseline_gpus)


def strong_scaling_efficiency(job: TrainingJob, baseline_gpus: int, global_batch: int) -> float:
    """Speed-up over ``baseline_gpus`` divided by the GPU ratio, for a fixed ``global_batch`` of samples.

    Data parallel: each GPU's share of the batch shrinks, while the gradients to reduce do not.
    Pipeline: each pipeline's micro-batches shrink, so the fill-and-drain bubble weighs more.
    """
    def at(gpus: int) -> TrainingJob:
        if job.strategy == "pp":
            pipelines = gpus // job.stages
            micro = global_batch // (pipelines * job.model.samples_per_gpu)
            if micro < 1:
                raise ConfigError("global_batch", f"{global_batch} samples leave a pipeline of {gpus} GPUs idle")
            return replace(job, gpus=gpus, micro_batches=micro)
        per_gpu = global_batch // gpus
        if per_gpu < 1:
            raise ConfigError("global_batch", f"{global_batch} samples cannot feed {gpus} GPUs")
        return replace(job, gpus=gpus, model=replace(job.model, samples_per_gpu=per_gpu))

    base, scaled = at(baseline_gpus), at(job.gpus)
    speedup = base.step().total_s / scaled.step().total_s
    return speedup / (job.gpus / baseline_gpus)
