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
* **Pipeline** parallelism (1F1B) idles ``(stages-1)`` micro-batch times of the slowest stage
  (whole layers per stage: it holds ``ceil(layers/stages)``). Placement is pipeline-major: a
  pipeline's stages are consecutive GPUs, so a node holds consecutive stages of one or two
  pipelines, activations mostly cross NVLink or PCIe, and a stage's data-parallel group spans
  ``pipelines`` GPUs on as many nodes as the stage count allows (PP=10: one GPU per node, each of
  a node's eight GPUs in another stage's group). Those groups share the node's NIC and host
  memory; staggered, each starts when its stage's backward ends (stage 0 last) and they queue.
  Activation sends hide under the next micro-batch except on the fill and drain. A stage whose
  weights, gradients and Adam state exceed the GPU's memory shards the Adam state over its
  data-parallel group (ZeRO-1: reduce-scatter + all-gather, the bytes of one allreduce).
* **Mixture of experts** (DeepSeekMoE-16B): compute counts the active parameters (2.8B of 16.4B);
  there is no expert parallelism — a stage holds all its layers' experts — so every parameter's
  gradient is reduced and stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cluster_model.collectives import Collective
from cluster_model.config import ConfigError
from cluster_model.node import Node

__all__ = ["GPU_MEMORY_BYTES", "MODELS", "P2P_LATENCY_S", "MemoryPlan", "ModelSpec", "StepTime", "TrainingJob",
           "strong_scaling_efficiency", "weak_scaling_efficiency"]


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


#: A100-40GB (both node designs of the reference file): 40 GiB of HBM per GPU.
GPU_MEMORY_BYTES = 40 * (1 << 30)
#: Assumption: one point-to-point send's fixed cost (kernel launch, NIC and switch), whatever the path.
P2P_LATENCY_S = 10e-6


def _optimizer_bytes_per_param(precision: str) -> int:
    """Adam's state: two fp32 moments, plus an fp32 master copy of the weights under mixed precision."""
    return 12 if precision == "fp16" else 8


@dataclass(frozen=True)
class MemoryPlan:
    """Model state held by the GPU with the most of it: weights, gradients and Adam state (bytes).

    Activations are not counted: this model takes them to fit in what is left (activation
    checkpointing where needed), so a plan that fits says the model state fits, no more.
    """

    params_per_gpu: float           # parameters whose weights and gradients this GPU holds
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float          # after sharding
    optimizer_shards: int           # 1: every GPU holds its parameters' Adam state (no ZeRO)
    capacity_bytes: int

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def sharded(self) -> bool:
        return self.optimizer_shards > 1


@dataclass(frozen=True)
class StepTime:
    """One training step (seconds): GPU compute, communication left exposed, pipeline bubble, and the
    point-to-point activation sends left exposed (pipeline only)."""

    compute_s: float
    exposed_comm_s: float
    bubble_s: float = 0.0
    p2p_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.bubble_s + self.p2p_s


@dataclass(frozen=True)
class TrainingJob:
    """A model trained on ``gpus`` GPUs of one node design with one strategy and library.

    ``collective`` prices every allreduce when given (a topology-aware one, say); otherwise a
    plain :class:`Collective` on ``node``. ``global_batch`` (pipeline only) fixes the samples per
    step, and with it the micro-batches per pipeline; without it ``micro_batches`` is used.
    """

    model: ModelSpec
    node: Node
    gpus: int
    strategy: str = "dp"                  # "dp", "fsdp" or "pp"
    library: str = "hfreduce"             # "hfreduce" or "nccl"
    stages: int = 1                       # pipeline stages (strategy "pp")
    micro_batches: int = 1                # per pipeline step (when global_batch is None)
    staggered: bool = True                # each stage reduces when its backward ends (strategy "pp")
    nvlink: bool = False                  # HFReduce with NVLink
    bucket_bytes: int = 25 << 20          # DDP gradient bucket (torch default)
    cross_zone_gbs: float | None = None
    collective: Collective | None = None
    global_batch: int | None = None       # samples per step (strategy "pp")
    gpu_memory_bytes: int = GPU_MEMORY_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus <= 0:
            raise ConfigError("training.gpus", f"must be a positive whole number, not {self.gpus!r}")
        if self.strategy not in ("dp", "fsdp", "pp"):
            raise ConfigError("training.strategy", f"must be dp, fsdp or pp, not {self.strategy!r}")
        if self.library not in ("hfreduce", "nccl"):
            raise ConfigError("training.library", f"must be hfreduce or nccl, not {self.library!r}")
        if self.strategy == "pp" and (isinstance(self.stages, bool) or not isinstance(self.stages, int)
                                      or self.stages < 2 or self.gpus % self.stages):
            raise ConfigError("training.stages", f"{self.stages} stages do not divide {self.gpus} GPUs")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches <= 0:
            raise ConfigError("training.micro_batches", f"must be a positive whole number, not {self.micro_batches!r}")
        if self.global_batch is not None:
            self._check_global_batch(self.global_batch)
        if self.strategy == "pp" and 1 < self.model.layers < self.stages:
            raise ConfigError("training.stages", f"{self.stages} stages leave some of {self.model.name}'s "
                                                 f"{self.model.layers} layers' stages empty")
        for name in ("gpu_memory_bytes", "bucket_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"training.{name}", f"must be a positive whole number of bytes, not {value!r}")
        self.memory()  # refuses a model whose state cannot fit even sharded

    def _check_global_batch(self, global_batch: int) -> None:
        field = "training.global_batch"
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch <= 0:
            raise ConfigError(field, f"must be a positive whole number, not {global_batch!r}")
        if self.strategy != "pp":
            raise ConfigError(field, "sets micro-batches per pipeline: strategy pp only")
        per_pipeline = self.pipelines * self.model.samples_per_gpu
        if global_batch % per_pipeline:
            raise ConfigError(field, f"{global_batch} samples are not a whole number of micro-batches of "
                                     f"{self.model.samples_per_gpu} for each of {self.pipelines} pipelines")

    # -- layout ----------------------------------------------------------------------------------

    @property
    def pipelines(self) -> int:
        """Data-parallel replicas: one per pipeline (every GPU is one under dp and fsdp)."""
        return self.gpus // self.stages if self.strategy == "pp" else self.gpus

    @property
    def micro_batches_per_pipeline(self) -> int:
        """``global_batch / pipelines / micro-batch size`` when a global batch is given."""
        if self.global_batch is None:
            return self.micro_batches
        return self.global_batch // (self.pipelines * self.model.samples_per_gpu)

    @property
    def _stage_layers(self) -> int:
        """Layers of the largest stage: whole layers per stage, so the slowest holds ``ceil(L/S)``."""
        return -(-self.model.layers // self.stages) if self.strategy == "pp" else self.model.layers

    @property
    def _stage_fraction(self) -> float:
        """Fraction of the model (FLOPs and parameters) on the largest stage."""
        if self.strategy != "pp":
            return 1.0
        if self.model.layers < self.stages:  # a model given without its layers: an even split
            return 1 / self.stages
        return self._stage_layers / self.model.layers

    def _node_of(self, rank: int) -> int:
        return rank // self.node.gpus

    def _rank(self, pipeline: int, stage: int) -> int:
        """Pipeline-major placement: a pipeline's stages are consecutive GPUs (ranks), so most
        activation sends stay inside a node; a node holds consecutive stages of one or two pipelines."""
        return pipeline * self.stages + stage

    # -- memory ----------------------------------------------------------------------------------

    def memory(self) -> MemoryPlan:
        """Model state per GPU, with Adam's state sharded over the data-parallel group if it must be.

        Weights and gradients are held at ``grad_bytes_per_param`` each; Adam adds two fp32 moments
        and, under fp16, an fp32 master copy (16 bytes a parameter in all). FSDP shards all three
        over every GPU. A pipeline stage or a DDP replica that does not fit shards only the Adam
        state over its data-parallel group (ZeRO-1: the gradients are reduce-scattered and the
        updated weights all-gathered, the same bytes as one allreduce); one that still does not fit,
        or has no group to shard over, is refused.
        """
        spec = self.model
        params = spec.params * self._stage_fraction
        per_param = spec.grad_bytes_per_param
        optimizer = params * _optimizer_bytes_per_param(spec.precision)
        if self.strategy == "fsdp":
            plan = MemoryPlan(params / self.gpus, params * per_param / self.gpus, params * per_param / self.gpus,
                              optimizer / self.gpus, self.gpus, self.gpu_memory_bytes)
        else:
            plan = MemoryPlan(params, params * per_param, params * per_param, optimizer, 1, self.gpu_memory_bytes)
            if plan.total_bytes > self.gpu_memory_bytes and self.pipelines > 1:
                plan = replace(plan, optimizer_bytes=optimizer / self.pipelines, optimizer_shards=self.pipelines)
        if plan.total_bytes > self.gpu_memory_bytes:
            raise ConfigError("training.gpus", f"{spec.name} needs {plan.total_bytes / 1e9:.1f} GB of model state "
                                               f"per GPU even sharded, over {self.gpu_memory_bytes / 1e9:.1f} GB")
        return plan

    # -- pieces --------------------------------------------------------------------------------

    @property
    def _tflops(self) -> float:
        return self.node.fp16_tflops if self.model.precision == "fp16" else self.node.tf32_tflops

    @property
    def _collective(self) -> Collective:
        return self.collective if self.collective is not None else Collective(self.node)

    def _compute_s(self, samples: float, fraction: float = 1.0) -> float:
        return 3 * self.model.fwd_flops_per_sample * samples * fraction / (self._tflops * 1e12 * self.model.mfu)

    def _allreduce_s(self, gpus: int, nbytes: float) -> float:
        if gpus <= 1 or nbytes <= 0:
            return 0.0
        collective = self._collective
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
        # allreduce's bytes (a tree's broadcast or reduce half), so 1.5 allreduces of the parameters.
        shard_bytes = self.model.params * self.model.grad_bytes_per_param
        half = 0.5 * self._allreduce_s(self.gpus, shard_bytes)
        if self.library == "nccl":
            return StepTime(compute, 3 * half)  # as for DDP: NCCL's kernels do not overlap on this node
        # Layer by layer, the forward gather hides under the forward pass and the backward gather
        # and reduce-scatter under the backward pass; what a pass cannot hide is exposed, and the
        # first layer's gather always is.
        forward, backward = compute / 3, compute * 2 / 3
        first_layer = half / max(1, self.model.layers)
        return StepTime(compute, max(0.0, half - forward) + max(0.0, 2 * half - backward) + first_layer)

    def _pipeline(self) -> StepTime:
        stages, micro = self.stages, self.micro_batches_per_pipeline
        per_micro = self._compute_s(self.model.samples_per_gpu, self._stage_fraction)
        compute = per_micro * micro
        bubble = per_micro * (stages - 1)          # 1F1B: fill and drain, (S-1) micro-batch times
        return StepTime(compute, self._pipeline_allreduce_s(per_micro * 2 / 3), bubble,
                        self._pipeline_p2p_s(per_micro))

    def _p2p_gbs(self, sender: int) -> float:
        """Per-direction bandwidth from rank ``sender`` to ``sender + 1``: NVLink bridge, PCIe
        peer-to-peer (which shares the root complex's GPU↔NIC ceiling), or GPU→NIC→NIC→GPU."""
        node = self.node
        if self._node_of(sender) != self._node_of(sender + 1):
            return node.gpu_nic_gbs
        local = sender % node.gpus
        if node.nvswitch or (local, local + 1) in node.nvlink_pairs or (local + 1, local) in node.nvlink_pairs:
            return node.nvlink_gbs / 2
        return min(node.gpu_nic_p2p_gbs or node.pcie_gpu_to_cpu_gbs, node.slowest_d2h_gbs)

    def pipeline_hop_s(self) -> float:
        """The slowest stage-to-stage send of one micro-batch's activations (``seq x hidden x 2`` bytes
        a sample; its gradient goes back the same way): all pipelines run in step, so it sets the pace."""
        nbytes = self.model.activation_bytes_per_sample * self.model.samples_per_gpu
        if nbytes <= 0:
            return 0.0
        slowest = min(self._p2p_gbs(self._rank(p, s)) for p in range(self.pipelines) for s in range(self.stages - 1))
        return nbytes / (slowest * 1e9) + P2P_LATENCY_S

    def _pipeline_p2p_s(self, per_micro_s: float) -> float:
        # Sends are asynchronous, so in the steady state each hides under the next micro-batch's
        # compute (activations forward and gradients back use the two directions of a link). The
        # first micro-batch's forward and the last one's backward cross every boundary on the
        # critical path: 2(S-1) sends exposed, plus any excess of a send over a micro-batch.
        hop = self.pipeline_hop_s()
        return 2 * (self.stages - 1) * hop + self.micro_batches_per_pipeline * max(0.0, hop - per_micro_s)

    def dp_group_layout(self, stage: int) -> tuple[int, int]:
        """Stage ``stage``'s data-parallel group as (nodes it spans, most of its GPUs on one node)."""
        per_node: dict[int, int] = {}
        for pipeline in range(self.pipelines):
            node = self._node_of(self._rank(pipeline, stage))
            per_node[node] = per_node.get(node, 0) + 1
        return len(per_node), max(per_node.values())

    def _stage_allreduce_s(self, stage: int) -> float:
        if self.pipelines == 1:
            return 0.0
        nbytes = int(self.model.params * self._stage_fraction * self.model.grad_bytes_per_param)
        nodes, local = self.dp_group_layout(stage)
        collective = self._collective
        if self.library == "hfreduce":
            # The host sums the group's GPUs on a node first; an uneven group is priced at its
            # fullest node (the slowest).
            return collective.hfreduce(nodes * local, nbytes, cross_zone_gbs=self.cross_zone_gbs,
                                       gpus_per_node=local).time_s
        return collective.nccl(nodes * self.node.gpus if nodes > 1 else local, nbytes, self.cross_zone_gbs).time_s

    def _pipeline_allreduce_s(self, backward_per_micro_s: float) -> float:
        """Exposed data-parallel reduction (an allreduce, or ZeRO-1's reduce-scatter + all-gather).

        Stage ``s``'s last backward ends ``s`` micro-batch backwards before stage 0's, which ends
        the step's compute. A node's stages share its NIC and host memory: their reductions queue,
        first released first served, each for its full time (conservative where copies, not the
        NIC, bound one). Staggered, each starts when its stage's backward ends; not staggered, all
        start when the whole pipeline has drained.
        """
        if self.pipelines == 1:
            return 0.0
        durations = [self._stage_allreduce_s(s) for s in range(self.stages)]
        nodes = -(-self.gpus // self.node.gpus)
        exposed = 0.0
        for node in range(nodes):
            ranks = range(node * self.node.gpus, min(self.gpus, (node + 1) * self.node.gpus))
            held = sorted({rank % self.stages for rank in ranks}, reverse=True)  # earliest release first
            clock = -math.inf
            for stage in held:
                release = -stage * backward_per_micro_s if self.staggered else 0.0
                clock = max(clock, release) + durations[stage]
            exposed = max(exposed, clock)
        return exposed

    # -- scaling -------------------------------------------------------------------------------

    def samples_per_s(self) -> float:
        per_step = self.model.samples_per_gpu * (self.gpus if self.strategy != "pp" else self.pipelines
                                                 * self.micro_batches_per_pipeline)
        return per_step / self.step().total_s


def weak_scaling_efficiency(job: TrainingJob, baseline_gpus: int) -> float:
    """Throughput per GPU at ``job.gpus`` over throughput per GPU at ``baseline_gpus`` (same per-GPU batch)."""
    batch = None if job.global_batch is None else job.global_batch * baseline_gpus // job.gpus
    base = replace(job, gpus=baseline_gpus, global_batch=batch)
    return (job.samples_per_s() / job.gpus) / (base.samples_per_s() / baseline_gpus)


def strong_scaling_efficiency(job: TrainingJob, baseline_gpus: int, global_batch: int) -> float:
    """Speed-up over ``baseline_gpus`` divided by the GPU ratio, for a fixed ``global_batch`` of samples.

    Data parallel: each GPU's share of the batch shrinks, while the gradients to reduce do not.
    Pipeline: each pipeline's micro-batches shrink, so the fill-and-drain bubble weighs more; a
    batch that is not a whole number of micro-batches per pipeline is refused (``training.global_batch``).
    """
    def at(gpus: int) -> TrainingJob:
        if job.strategy == "pp":
            return replace(job, gpus=gpus, global_batch=global_batch)
        per_gpu = global_batch // gpus
        if per_gpu < 1:
            raise ConfigError("global_batch", f"{global_batch} samples cannot feed {gpus} GPUs")
        return replace(job, gpus=gpus, model=replace(job.model, samples_per_gpu=per_gpu))

    base, scaled = at(baseline_gpus), at(job.gpus)
    speedup = base.step().total_s / scaled.step().total_s
    return speedup / (job.gpus / baseline_gpus)
