"""Every figure the model reproduces, with the paper's value where the reference file has one.

:func:`reproduce` is what the report prints and what the tests check: one :class:`Row` per
figure, with the model's value, the paper's (None where the reference file has none) and the
tolerance it is held to (0 for counts and cost arithmetic, 10 % for bandwidths and step times).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cluster_model.cluster import Cluster
from cluster_model.storage import CHECKPOINT_BYTES_PER_PARAM
from cluster_model.training import MODELS, ModelSpec, TrainingJob

__all__ = ["FIG7A_MESSAGE_BYTES", "Row", "calibrated_models", "reproduce"]

FIG7A_MESSAGE_BYTES = 186 * (1 << 20)


@dataclass(frozen=True)
class Row:
    section: str
    figure: str           # where in the paper
    quantity: str
    model: float
    paper: float | None
    unit: str
    tolerance: float      # relative; 0: exact

    @property
    def error(self) -> float | None:
        if self.paper is None or self.paper == 0:
            return None
        return (self.model - self.paper) / self.paper

    @property
    def ok(self) -> bool | None:
        if self.error is None:
            return None
        return abs(self.error) <= self.tolerance + 1e-9


def calibrated_models(cluster: Cluster) -> dict[str, ModelSpec]:
    """The four models, VGG16's achieved GEMM fraction taken from Fig. 8a's first HFReduce step.

    The reference file gives that step as a calibration point: it fixes the one number a FLOP
    count cannot (how well VGG16's convolutions use the GPU); every other figure is predicted.
    """
    ref = cluster.config.get("haiscale", {}).get("vgg16_ddp")
    models: dict[str, ModelSpec] = dict(MODELS)
    if ref:
        gpus, step = int(ref["gpus"][0]), float(ref["hfreduce_s"][0])
        spec = MODELS["vgg16"]
        job = TrainingJob(spec, cluster.node, gpus)
        exposed = job.step().exposed_comm_s
        compute = step - exposed
        tflops = cluster.node.tf32_tflops * 1e12
        mfu = 3 * spec.fwd_flops_per_sample * spec.samples_per_gpu / (tflops * compute)
        models["vgg16"] = replace(spec, mfu=mfu)
    return models


def reproduce(cluster: Cluster) -> list[Row]:
    cfg = cluster.config
    rows: list[Row] = []
    net_cfg = cfg["network"]
    network = cluster.network
    radix = int(net_cfg["switch_ports"])

    # -- topology ----------------------------------------------------------------------------
    zone_ports = radix * radix // 2
    rows.append(Row("Topology", "Sec. III-B", "endpoint ports of one zone (two-layer fat-tree)", zone_ports,
                    net_cfg.get("two_layer_fat_tree_ports"), "ports", 0))
    rows.append(Row("Topology", "Sec. III-B", "switches per zone (spine + leaf)",
                    network.switches / network.zones, 60 if radix == 40 else None, "switches", 0))
    rows.append(Row("Topology", "Sec. III-B", "zones", network.zones, net_cfg.get("zones"), "", 0))
    rows.append(Row("Topology", "Fig. 5", "switches, two-zone network", network.switches, None, "switches", 0))
    rows.append(Row("Topology", "Fig. 5", "cables, two-zone network", network.links, None, "links", 0))
    rows.append(Row("Topology", "Fig. 5", "leaf oversubscription with every node placed", network.oversubscription,
                    None, "down/up", 0))
    dgx_net, dgx_cost = cluster.dgx_equivalent()
    rows.append(Row("Topology", "Sec. III-B", "switches, DGX cluster on a three-layer fat-tree", dgx_net.switches,
                    None, "switches", 0))

    # -- node and collectives ------------------------------------------------------------------
    hf = cfg.get("hfreduce", {})
    collective = cluster.collective
    rows.append(Row("Collectives", "Sec. IV-D", "HFReduce host-memory bound", collective.hfreduce_bound_gbs(), None,
                    "GB/s", 0.10))
    for gpus, hf_paper, nccl_paper in zip(hf.get("fig7a_gpus", []), hf.get("fig7a_hfreduce_gbs", []),
                                          hf.get("fig7a_nccl_gbs", []), strict=False):
        rows.append(Row("Collectives", "Fig. 7a", f"HFReduce allreduce 186 MiB, {gpus} GPUs",
                        collective.hfreduce(gpus, FIG7A_MESSAGE_BYTES).algbw_gbs, hf_paper, "GB/s", 0.10))
        rows.append(Row("Collectives", "Fig. 7a", f"NCCL allreduce 186 MiB, {gpus} GPUs",
                        collective.nccl(gpus, FIG7A_MESSAGE_BYTES).algbw_gbs, nccl_paper, "GB/s", 0.10))
    rows.append(Row("Collectives", "Sec. IV-D", "HFReduce measured bandwidth (about), 16 GPUs",
                    collective.hfreduce(16, FIG7A_MESSAGE_BYTES).algbw_gbs, hf.get("measured_gbs_about"), "GB/s",
                    0.10))
    rows.append(Row("Collectives", "Fig. 7b", "HFReduce with NVLink, 186 MiB, 64 GPUs",
                    collective.hfreduce(64, FIG7A_MESSAGE_BYTES, nvlink=True).algbw_gbs, None, "GB/s", 0.10))

    # -- training --------------------------------------------------------------------------------
    models = calibrated_models(cluster)
    vgg = cfg.get("haiscale", {}).get("vgg16_ddp", {})
    for index, gpus in enumerate(vgg.get("gpus", [])):
        for library, key in (("hfreduce", "hfreduce_s"), ("nccl", "torch_nccl_s")):
            job = TrainingJob(models["vgg16"], cluster.node, int(gpus), library=library)
            rows.append(Row("Training", "Fig. 8a", f"VGG16 DDP step, {library}, {gpus} GPUs", job.step().total_s,
                            vgg[key][index], "s", 0.10))

    # -- storage ---------------------------------------------------------------------------------
    st_cfg = cfg.get("storage_3fs", {})
    storage = cluster.storage
    rows.append(Row("Storage", "Sec. VI-B", "3FS read, theoretical", storage.read_theoretical_gbs() / 1000,
                    9.0 if st_cfg.get("read_tbs_achieved") is not None else None, "TB/s", 0.0))
    rows.append(Row("Storage", "Sec. VI-B", "3FS read, achieved (request-to-send flow control)",
                    storage.read_gbs() / 1000, st_cfg.get("read_tbs_achieved"), "TB/s", 0.10))
    rows.append(Row("Storage", "Table IV", "raw capacity", storage.raw_capacity_pb, None, "PB", 0))
    rows.append(Row("Storage", "Sec. VI-B", "3FS write (3 replicas)", storage.write_gbs() / 1000, None, "TB/s", 0.10))
    per_node_gbs = cluster.checkpoint_write_gbs_per_node
    llama = MODELS["llama-13b"].params * CHECKPOINT_BYTES_PER_PARAM
    rows.append(Row("Storage", "Sec. VII-A", "LLaMA-13B checkpoint (Adam state) from 32 nodes",
                    storage.checkpoint_s(llama, 32, per_node_gbs), None, "s", 0.10))

    # -- cost and energy -------------------------------------------------------------------------
    prices = cfg.get("price_relative", {})
    ours = cluster.cost()
    pcie_node = cluster.cost_model.node_price["pcie_a100"]
    dgx_node = cluster.cost_model.node_price["dgx_a100"]
    rows.append(Row("Cost", "Table II", "PCIe node price / DGX node price", round(pcie_node / dgx_node, 2),
                    prices.get("pcie_node_vs_dgx_node"), "", 0.02))
    rows.append(Row("Cost", "Table III", "servers, PCIe cluster", ours.server_price, prices.get("pcie_servers_10k"),
                    "rel.", 0))
    rows.append(Row("Cost", "Table III", "network, two-zone", ours.network_price,
                    prices.get("pcie_network_two_zone"), "rel.", 0))
    rows.append(Row("Cost", "Table III", "servers, DGX cluster", dgx_cost.server_price, prices.get("dgx_servers_10k"),
                    "rel.", 0))
    rows.append(Row("Cost", "Table III", "network, DGX three-layer fat-tree", dgx_cost.network_price, None, "rel.", 0))
    rows.append(Row("Cost", "Table III", "cluster price PCIe / DGX", ours.price / dgx_cost.price, None, "", 0))
    gemm = cfg.get("gemm_tflops_per_gpu", {})
    rows.append(Row("Cost", "Table II", "TF32 GEMM PCIe / DGX", cluster.node.tf32_tflops /
                    cluster.nodes["dgx_a100"].tf32_tflops,
                    gemm["pcie_tf32"] / gemm["dgx_tf32"] if gemm else None, "", 0))
    rows.append(Row("Cost", "Table III", "TF32 per price, PCIe / DGX",
                    ours.tflops_per_price / dgx_cost.tflops_per_price, None, "", 0))
    rows.append(Row("Energy", "Table II", "node power PCIe / DGX",
                    cluster.node.power_w / cluster.nodes["dgx_a100"].power_w, None, "", 0))
    rows.append(Row("Energy", "Table II", "cluster power, PCIe", ours.power_kw, None, "kW", 0))
    rows.append(Row("Energy", "Table II", "cluster power, DGX", dgx_cost.power_kw, None, "kW", 0))

    # -- failures --------------------------------------------------------------------------------
    failures = cluster.failures
    xid = cfg.get("failures", {}).get("xid_year", {})
    rows.append(Row("Failures", "Table VI", "Xid errors in a year", failures.total, xid.get("total"), "", 0))
    rows.append(Row("Failures", "Table VI", "NVLink (Xid 74) share of Xids", failures.xid_counts.get(74, 0) /
                    failures.total, None, "", 0))
    rows.append(Row("Failures", "Table VI", "interrupting Xids per GPU per day", failures.per_gpu_day(), None, "", 0))
    for job_gpus in (512, 2048):
        rows.append(Row("Failures", "Table VI", f"interruptions per day, {job_gpus}-GPU job",
                        failures.interruptions_per_day(job_gpus), None, "/day", 0))
    llama_ckpt_s = storage.checkpoint_s(llama, 32, per_node_gbs)
    rows.append(Row("Failures", "Sec. VII-A", "Young/Daly interval, LLaMA-13B on 256 GPUs",
                    failures.optimal_interval_s(256, llama_ckpt_s), None, "s", 0))
    return rows
