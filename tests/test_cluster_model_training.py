"""cluster_model training: pipeline mechanics, memory plans, and the Fig. 8/9 predictions behave."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster_model import Collective, ConfigError, TrainingJob, load_cluster
from cluster_model.cluster import Cluster
from cluster_model.collectives import AllreduceResult
from cluster_model.reproduce import calibrated_models
from cluster_model.scaling import FIG8A_GPUS, FIG8B_GPUS, FIG9A, FIG9B, training_predictions
from cluster_model.training import GPU_MEMORY_BYTES, P2P_LATENCY_S, ModelSpec, strong_scaling_efficiency


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return load_cluster()


@pytest.fixture(scope="module")
def models(cluster: Cluster) -> dict[str, ModelSpec]:
    return calibrated_models(cluster)


def _pp(models: dict[str, ModelSpec], cluster: Cluster, name: str, gpus: int, stages: int, batch: int,
        **kw: object) -> TrainingJob:
    return TrainingJob(models[name], cluster.node, gpus, strategy="pp", stages=stages, global_batch=batch,
                       **kw)  # type: ignore[arg-type]


def test_weak_scaling_never_gets_faster_per_step(cluster: Cluster, models: dict[str, ModelSpec]) -> None:
    for name, strategy, counts in (("vgg16", "dp", (32, 64, *FIG8A_GPUS)), ("gpt2-medium", "fsdp", FIG8B_GPUS)):
        for library in ("hfreduce", "nccl"):
            steps = [TrainingJob(models[name], cluster.node, g, strategy=strategy, library=library).step().total_s
                     for g in counts]
            assert steps == sorted(steps), (name, library, steps)


def test_hfreduce_step_never_exceeds_nccl_on_the_pcie_node(cluster: Cluster, models: dict[str, ModelSpec]) -> None:
    for name, strategy, counts in (("vgg16", "dp", (32, 64, *FIG8A_GPUS)), ("gpt2-medium", "fsdp", FIG8B_GPUS)):
        for gpus in counts:
            hf = TrainingJob(models[name], cluster.node, gpus, strategy=strategy).step()
            nccl = TrainingJob(models[name], cluster.node, gpus, strategy=strategy, library="nccl").step()
            assert hf.total_s <= nccl.total_s
            assert hf.compute_s == nccl.compute_s  # the libraries differ only in what they expose


def test_strong_scaling_falls_with_gpus_at_efficiency_at_most_one(cluster: Cluster,
                                                                  models: dict[str, ModelSpec]) -> None:
    for setup in (FIG9A, FIG9B):
        jobs = [_pp(models, cluster, setup.model, g, setup.stages, setup.global_batch) for g in setup.gpus]
        steps = [job.step().total_s for job in jobs]
        assert steps == sorted(steps, reverse=True) and len(set(steps)) == len(steps)
        for job in jobs[1:]:
            assert 0 < strong_scaling_efficiency(job, setup.gpus[0], setup.global_batch) <= 1.0
        # Micro-batches per pipeline: global batch / pipelines / micro-batch size.
        assert [j.micro_batches_per_pipeline for j in jobs] == [
            setup.global_batch // (g // setup.stages) for g in setup.gpus]


def test_bubble_fraction_grows_as_micro_batches_shrink(cluster: Cluster, models: dict[str, ModelSpec]) -> None:
    fractions = []
    for gpus in FIG9B.gpus:
        job = _pp(models, cluster, FIG9B.model, gpus, FIG9B.stages, FIG9B.global_batch)
        step = job.step()
        # 1F1B: (S-1) micro-batch times of bubble against m micro-batch times of compute.
        assert step.bubble_s / step.compute_s == pytest.approx((FIG9B.stages - 1) / job.micro_batches_per_pipeline)
        fractions.append(step.bubble_s / step.total_s)
    assert fractions == sorted(fractions) and fractions[0] < fractions[-1]


def test_slowest_stage_holds_whole_layers(cluster: Cluster, models: dict[str, ModelSpec]) -> None:
    moe = models["deepseekmoe-16b"]           # 28 layers on 10 stages: the slowest holds 3
    job = _pp(models, cluster, "deepseekmoe-16b", 40, 10, 4608)
    per_micro = 3 * moe.fwd_flops_per_sample * (3 / 28) / (cluster.node.fp16_tflops * 1e12 * moe.mfu)
    assert job.step().bubble_s == pytest.approx(9 * per_micro)
    assert job.memory().params_per_gpu == pytest.approx(moe.params * 3 / 28)  # all experts' parameters


def test_memory_plan_shards_adam_state_or_refuses(cluster: Cluster, models: dict[str, ModelSpec]) -> None:
    llama = _pp(models, cluster, "llama-13b", 64, 4, 4096)
    plan = llama.memory()
    # 13e9 x 16 / 4 = 52 GB does not fit 40 GiB: Adam state sharded over the 16 replicas.
    assert GPU_MEMORY_BYTES < 13e9 / 4 * 16
    assert plan.sharded and plan.optimizer_shards == 16
    assert plan.total_bytes == pytest.approx(13e9 / 4 * (2 + 2 + 12 / 16))
    moe = _pp(models, cluster, "deepseekmoe-16b", 40, 10, 4608).memory()
    assert not moe.sharded and moe.total_bytes == pytest.approx(16.4e9 * 3 / 28 * 16)
    # Sharding changes where the bytes go, not how many cross the network (one allreduce's worth).
    unsharded = replace(llama, gpu_memory_bytes=10**12)
    assert not unsharded.memory().sharded
    assert unsharded.step().total_s == pytest.approx(llama.step().total_s)
    with pytest.raises(ConfigError, match=r"training\.gpus"):
        _pp(models, cluster, "llama-13b", 4, 4, 4)        # one pipeline: no group to shard over
    with pytest.raises(ConfigError, match=r"training\.gpus"):
        TrainingJob(models["llama-13b"], cluster.node, 64)  # 13e9 x 4 bytes of weights and gradients alone


def test_pipeline_placement_and_point_to_point(cluster: Cluster, models: dict[str, ModelSpec]) -> None:
    node = cluster.node
    ten = _pp(models, cluster, "deepseekmoe-16b", 40, 10, 4608)
    # PP=10 on 8-GPU nodes: each stage's DP group has one GPU on each of 4 nodes.
    assert all(ten.dp_group_layout(s) == (4, 1) for s in range(10))
    act = 4096 * 2048 * 2
    assert ten.pipeline_hop_s() == pytest.approx(act / (node.gpu_nic_gbs * 1e9) + P2P_LATENCY_S)
    four = _pp(models, cluster, "llama-13b", 64, 4, 4096)
    assert all(four.dp_group_layout(s) == (8, 2) for s in range(4))
    pcie_p2p = min(node.gpu_nic_p2p_gbs or node.pcie_gpu_to_cpu_gbs, node.slowest_d2h_gbs)
    assert four.pipeline_hop_s() == pytest.approx(2048 * 5120 * 2 / (pcie_p2p * 1e9) + P2P_LATENCY_S)
    # Fill and drain expose 2(S-1) sends; the steady state hides them under compute.
    assert four.step().p2p_s == pytest.approx(2 * 3 * four.pipeline_hop_s())
    packed = replace(ten, staggered=False)
    assert ten.step().exposed_comm_s < packed.step().exposed_comm_s


class _SlowCollective(Collective):
    """A collective that says every allreduce takes one second: the job must use it."""

    def hfreduce(self, gpus: int, message_bytes: int, nvlink: bool = False,
                 cross_zone_gbs: float | None = None, gpus_per_node: int | None = None,
                 zones: int = 1) -> AllreduceResult:
        return AllreduceResult("slow", gpus, message_bytes, 1.0, "test")

    def nccl(self, gpus: int, message_bytes: int, cross_zone_gbs: float | None = None,
             algorithm: str = "double binary tree", zones: int = 1) -> AllreduceResult:
        return AllreduceResult("slow", gpus, message_bytes, 2.0, "test")


def test_a_given_collective_prices_every_allreduce(cluster: Cluster, models: dict[str, ModelSpec]) -> None:
    slow = _SlowCollective(cluster.node)
    nccl = TrainingJob(models["vgg16"], cluster.node, 64, library="nccl", collective=slow).step()
    assert nccl.exposed_comm_s == 2.0
    fsdp = TrainingJob(models["gpt2-medium"], cluster.node, 64, strategy="fsdp", library="nccl",
                       collective=slow).step()
    assert fsdp.exposed_comm_s == pytest.approx(3.0)
    pp = _pp(models, cluster, "deepseekmoe-16b", 40, 10, 4608, staggered=False, collective=slow).step()
    assert pp.exposed_comm_s == pytest.approx(8.0)  # a node's 8 stages queue on its NIC
    predictions = training_predictions(cluster, slow)
    assert {p.section for p in predictions} == {"Fig. 8a", "Fig. 8b", "Fig. 9a", "Fig. 9b"}


def test_predictions_cover_every_point_and_name_their_mechanism(cluster: Cluster) -> None:
    predictions = training_predictions(cluster)
    count = {s: sum(p.section == s for p in predictions) for s in ("Fig. 8a", "Fig. 8b", "Fig. 9a", "Fig. 9b")}
    assert count == {"Fig. 8a": 2 * len(FIG8A_GPUS), "Fig. 8b": 2 * len(FIG8B_GPUS), "Fig. 9a": len(FIG9A.gpus),
                     "Fig. 9b": len(FIG9B.gpus)}
    for p in predictions:
        assert p.value > 0 and p.unit == "s"
        assert p.mechanism.split(" dominates")[0] in ("compute", "bubble", "exposed allreduce", "p2p",
                                                      "exposed all-gather/reduce-scatter") \
            or p.mechanism.startswith("optimizer sharding")


def test_invalid_training_inputs_are_named(cluster: Cluster, models: dict[str, ModelSpec]) -> None:
    with pytest.raises(ConfigError, match=r"training\.global_batch"):
        _pp(models, cluster, "llama-13b", 64, 4, 4097)          # not whole micro-batches per pipeline
    with pytest.raises(ConfigError, match=r"training\.global_batch"):
        _pp(models, cluster, "llama-13b", 512, 4, 64)           # fewer samples than pipelines
    with pytest.raises(ConfigError, match=r"training\.global_batch"):
        TrainingJob(models["vgg16"], cluster.node, 64, global_batch=8192)  # pipeline only
    with pytest.raises(ConfigError, match=r"training\.gpus"):
        _pp(models, cluster, "llama-13b", 0, 4, 4096)
    with pytest.raises(ConfigError, match=r"training\.stages"):
        _pp(models, cluster, "deepseekmoe-16b", 64, 10, 4608)   # 10 stages do not divide 64 GPUs
    with pytest.raises(ConfigError, match=r"training\.micro_batches"):
        TrainingJob(models["vgg16"], cluster.node, 8, strategy="pp", stages=2, micro_batches=0)
