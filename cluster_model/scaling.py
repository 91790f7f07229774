"""Predicted training step times of Figs. 8a (continued), 8b, 9a and 9b, from their setups only.

Each point is a :class:`TrainingJob` built from the figure's stated inputs — model, GPU count,
strategy, library, and for Fig. 9 the pipeline depth and global batch — priced by the same
mechanisms as everything else (:mod:`training`, :mod:`collectives`). Nothing here is chosen per
figure: VGG16's achieved GEMM fraction comes from the reference file's calibration point
(:func:`reproduce.calibrated_models`), the other models' from :data:`training.MODELS`.

Weak scaling (Fig. 8) keeps each GPU's batch and adds GPUs; strong scaling (Fig. 9) keeps the
global batch, so each pipeline gets fewer micro-batches while the bubble and the stage's
gradient reduction stay the same size.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster_model.cluster import Cluster
from cluster_model.collectives import Collective
from cluster_model.predict import Prediction
from cluster_model.reproduce import calibrated_models
from cluster_model.training import StepTime, TrainingJob

__all__ = ["FIG8A_GPUS", "FIG8B_GPUS", "FIG9A", "FIG9B", "PipelineSetup", "training_predictions"]

FIG8A_GPUS = (128, 256, 512)          # continues the reference file's 32 and 64
FIG8B_GPUS = (16, 32, 64, 128)


@dataclass(frozen=True)
class PipelineSetup:
    """One Fig. 9 panel's inputs, as the issue states them."""

    section: str
    model: str
    seq: int
    global_batch: int                 # sequences per step
    stages: int                       # pipeline parallel; the rest is data parallel
    gpus: tuple[int, ...]


FIG9A = PipelineSetup("Fig. 9a", "llama-13b", 2048, 4096, 4, (64, 128, 256, 512))
FIG9B = PipelineSetup("Fig. 9b", "deepseekmoe-16b", 4096, 4608, 10, (40, 80, 160, 320, 640))

_LIBRARIES = {"dp": (("hfreduce", "HaiScale DDP on HFReduce"), ("nccl", "torch DDP on NCCL")),
              "fsdp": (("hfreduce", "HaiScale FSDP on HFReduce"), ("nccl", "torch FSDP on NCCL"))}


def _terms(job: TrainingJob, step: StepTime) -> list[tuple[str, float]]:
    """The step's terms, named as the mechanism text names them."""
    comm = "exposed allreduce"
    if job.strategy == "fsdp":
        comm = "exposed all-gather/reduce-scatter"
    elif job.strategy == "pp" and job.memory().sharded:
        comm = f"optimizer sharding (exposed reduce-scatter + all-gather over {job.memory().optimizer_shards})"
    terms = [("compute", step.compute_s), (comm, step.exposed_comm_s)]
    if job.strategy == "pp":
        terms += [("bubble", step.bubble_s), ("p2p", step.p2p_s)]
    return terms


def _mechanism(job: TrainingJob, step: StepTime, note: str) -> str:
    terms = _terms(job, step)
    name, seconds = max(terms, key=lambda kv: kv[1])
    split = ", ".join(f"{n} {s:.3g} s" for n, s in terms)
    return f"{name} dominates ({seconds / step.total_s:.0%}): {split}. {note}"


def _data_parallel(cluster: Cluster, collective: Collective | None) -> list[Prediction]:
    models = calibrated_models(cluster)
    out: list[Prediction] = []
    for section, name, strategy, label, counts in (
            ("Fig. 8a", "vgg16", "dp", "VGG16 DDP", FIG8A_GPUS),
            ("Fig. 8b", "gpt2-medium", "fsdp", "GPT2-Medium FSDP", FIG8B_GPUS)):
        spec = models[name]
        for gpus in counts:
            for library, library_label in _LIBRARIES[strategy]:
                job = TrainingJob(spec, cluster.node, gpus, strategy=strategy, library=library,
                                  collective=collective)
                step = job.step()
                passes = "the backward pass" if strategy == "dp" else "the forward and backward passes"
                overlap = (f"overlapped with {passes} (HFReduce uses no SMs)" if library == "hfreduce"
                           else f"not overlapped (NCCL kernels compete with {passes} on this node)")
                nbytes = f"{spec.params * spec.grad_bytes_per_param / 1e6:.0f} MB"
                what = (f"{nbytes} gradient allreduce" if strategy == "dp"
                        else f"1.5 allreduces of the {nbytes} parameters (gather, gather, reduce-scatter)")
                note = (f"Weak scaling, {spec.samples_per_gpu} samples per GPU, mfu {spec.mfu:.2f}; "
                        f"{what}, {overlap}.")
                out.append(Prediction(section, f"{gpus:,} GPUs, {library_label}", f"{label} step time",
                                      step.total_s, "s", _mechanism(job, step, note)))
    return out


def _pipeline(cluster: Cluster, collective: Collective | None, setup: PipelineSetup) -> list[Prediction]:
    spec = calibrated_models(cluster)[setup.model]
    out: list[Prediction] = []
    for gpus in setup.gpus:
        job = TrainingJob(spec, cluster.node, gpus, strategy="pp", stages=setup.stages,
                          global_batch=setup.global_batch, collective=collective)
        step = job.step()
        plan = job.memory()
        nodes, local = job.dp_group_layout(0)
        memory = (f"Adam state sharded over {plan.optimizer_shards} replicas (ZeRO-1), "
                  f"{plan.total_bytes / 1e9:.1f} GB model state per GPU" if plan.sharded
                  else f"{plan.total_bytes / 1e9:.1f} GB model state per GPU, unsharded")
        note = (f"Strong scaling: {job.pipelines} pipelines x {job.micro_batches_per_pipeline} micro-batches of "
                f"{spec.samples_per_gpu} x {setup.seq} tokens; 1F1B bubble {setup.stages - 1} micro-batch times; "
                f"each stage's DP group spans {nodes} nodes with {local} GPU(s) on each; {memory}; "
                f"HaiScale pipeline on HFReduce.")
        out.append(Prediction(setup.section, f"{gpus:,} GPUs, PP={setup.stages}, DP={job.pipelines}",
                              f"{spec.name} seconds per step", step.total_s, "s", _mechanism(job, step, note)))
    return out


def training_predictions(cluster: Cluster, collective: Collective | None = None) -> list[Prediction]:
    """One :class:`Prediction` per point and library of Figs. 8a (128 to 512 GPUs), 8b, 9a and 9b.

    ``collective`` prices every allreduce (a topology-aware one, say); without it, a plain
    :class:`Collective` on the cluster's node. Fig. 9 is HaiScale only: the issue names no
    second library for it.
    """
    return [*_data_parallel(cluster, collective), *_pipeline(cluster, collective, FIG9A),
            *_pipeline(cluster, collective, FIG9B)]
