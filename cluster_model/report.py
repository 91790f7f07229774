"""The Markdown report (and its PNG plots): every reproduced figure, then the model's curves."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cluster_model.calibration import calibration_section
from cluster_model.cluster import Cluster, load_cluster
from cluster_model.config import ConfigError
from cluster_model.cost import ClusterCost
from cluster_model.measured import Measured
from cluster_model.predict import FIG7A_GPUS, predictions
from cluster_model.reproduce import FIG7A_MESSAGE_BYTES, Row, calibrated_models, reproduce
from cluster_model.storage import CHECKPOINT_BYTES_PER_PARAM
from cluster_model.topology import multi_plane, spread_placement, three_layer_fat_tree
from cluster_model.training import TrainingJob, strong_scaling_efficiency, weak_scaling_efficiency

__all__ = ["PlotData", "render_report", "summary", "write_report"]

GPU_COUNTS = (16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class PlotData:
    gpus: list[int]
    allreduce: dict[str, list[float]]
    scaling_gpus: list[int]
    scaling: dict[str, list[float]]
    ours: ClusterCost
    dgx: ClusterCost
    xids: dict[int, int]


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 1):
        return f"{int(value):,}"
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def _table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> list[str]:
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(c) if isinstance(c, (int, float)) or c is None else str(c)
                                       for c in row) + " |")
    return lines


def _figures_table(rows: list[Row]) -> list[str]:
    out = []
    for row in rows:
        error = "-" if row.error is None else f"{row.error:+.1%}"
        verdict = "-" if row.ok is None else ("yes" if row.ok else "**no**")
        tolerance = "exact" if row.tolerance == 0 else f"±{row.tolerance:.0%}"
        out.append((row.section, row.figure, row.quantity, row.unit, row.paper, row.model, error, tolerance, verdict))
    return _table(("section", "paper", "quantity", "unit", "paper value", "model", "error", "held to", "within"),
                  out)


def _predictions_section(cluster: Cluster) -> list[str]:
    """The paper's other figures, predicted from their setups, and how the allreduce ones move with
    the two things the paper does not state (where a job's nodes sit, how many links join the zones)."""
    rows = predictions(cluster)
    lines = ["## Predictions", "",
             "The paper's figures that the reference file does not give, predicted from their setups alone "
             "(GPU counts, models, batches, topologies) with the mechanisms below; no value here was fitted. "
             "Each row names what sets it. Assumptions: `cluster_model/README.md`.", ""]
    lines += _table(("paper", "setup", "quantity", "prediction", "unit", "mechanism"),
                    [(r.section, r.setup, r.quantity, r.value, r.unit, r.mechanism) for r in rows])
    collective = cluster.collective
    scattered = replace(collective, placement="scattered")
    size = FIG7A_MESSAGE_BYTES
    lines += ["", "### How the allreduce predictions move with placement and the links between zones", "",
              "Packed (the predictions): a job on as few leaves as hold it. Scattered: its nodes dealt "
              "round-robin over all of a zone's leaves, as a fragmented cluster gives them; destination routing "
              "then puts several of its flows on one leaf uplink. The two-zone columns spread the job over both "
              "zones; the double binary tree crosses the cut on few edges, so one job needs little of the links "
              "between zones unless it is scattered.", ""]
    table = []
    fabric = cluster.fabric
    for gpus in FIG7A_GPUS:
        row: list[object] = [gpus, collective.hfreduce(gpus, size).algbw_gbs, scattered.hfreduce(gpus, size).algbw_gbs,
                             collective.nccl(gpus, size).algbw_gbs, scattered.nccl(gpus, size).algbw_gbs]
        if fabric.zones > 1:
            for links in (fabric.cross_zone_links, 1):
                narrow = replace(scattered, fabric=replace(fabric, cross_zone_links=links))
                row.append(narrow.hfreduce(gpus, size, nvlink=True, zones=2).algbw_gbs)
        table.append(row)
    header = ["GPUs", "HFReduce packed", "HFReduce scattered", "NCCL packed", "NCCL scattered"]
    if fabric.zones > 1:
        header += [f"HFReduce+NVLink scattered, 2 zones, {fabric.cross_zone_links} links", "... 1 link"]
    lines += _table(header, table)
    return [*lines, ""]


def summary(cluster: Cluster) -> dict[str, float]:
    """Headline numbers of one design (what ``whatif`` compares)."""
    cost = cluster.cost()
    job_gpus = min(cluster.gpus, 512)
    models = calibrated_models(cluster)
    llama = models["llama-13b"]
    ckpt_gbs = cluster.checkpoint_write_gbs_per_node
    ckpt_s = cluster.storage.checkpoint_s(llama.params * CHECKPOINT_BYTES_PER_PARAM,
                                          max(1, job_gpus // cluster.node.gpus), ckpt_gbs)
    return {
        "GPUs": cluster.gpus,
        "switches": cluster.network.switches,
        "leaf oversubscription": cluster.network.oversubscription,
        "bisection (Tbit/s)": cluster.network.bisection_gbps / 1000,
        "bisection within a zone (Tbit/s)": cluster.network.zone_bisection_gbps / 1000,
        "price (relative)": cost.price,
        "power (kW)": cost.power_kw,
        "TF32 PFLOPS": cost.tflops / 1000,
        "TF32 TFLOPS per price unit": cost.tflops_per_price,
        f"HFReduce 186 MiB, {job_gpus} GPUs (GB/s)":
            cluster.collective.hfreduce(job_gpus, FIG7A_MESSAGE_BYTES).algbw_gbs,
        f"NCCL 186 MiB, {job_gpus} GPUs (GB/s)": cluster.collective.nccl(job_gpus, FIG7A_MESSAGE_BYTES).algbw_gbs,
        "3FS read (TB/s)": cluster.storage.read_gbs() / 1000,
        "3FS write (TB/s)": cluster.storage.write_gbs() / 1000,
        f"LLaMA-13B checkpoint, {job_gpus} GPUs (s)": ckpt_s,
        f"interruptions/day, {job_gpus}-GPU job": cluster.failures.interruptions_per_day(job_gpus),
        f"Young/Daly interval, {job_gpus} GPUs (s)": cluster.failures.optimal_interval_s(job_gpus, ckpt_s),
    }


def render_report(cluster: Cluster, measured: Measured | None = None) -> tuple[str, PlotData]:
    """The report's Markdown, and the data its plots draw; ``measured`` adds checkpoint times at fs3's
    own write rate."""
    rows = reproduce(cluster)
    checked = [r for r in rows if r.ok is not None]
    within = sum(1 for r in checked if r.ok)
    lines = [f"# {cluster.name}: the model against the paper", "",
             f"{within} of {len(checked)} figures with a paper value are within their tolerance "
             "(exact for counts and cost arithmetic, 10% for bandwidths and step times). Relative error is "
             "(model - paper) / paper. Assumptions: `cluster_model/README.md`.", ""]
    lines += ["## Reproduced figures", "", *_figures_table(rows), ""]
    lines += _predictions_section(cluster)

    # -- topologies ------------------------------------------------------------------------
    net = cluster.config["network"]
    radix, port = int(net["switch_ports"]), float(net["port_gbps"])
    dgx_net, dgx_cost = cluster.dgx_equivalent()
    designs = [cluster.network, dgx_net, three_layer_fat_tree(radix, port),
               multi_plane(128, 400, 4)]
    lines += ["## Topologies", "",
              "Two-layer zones of 40-port switches against a three-layer tree for the same GPUs on DGX nodes "
              "(one access point per compute NIC), a full three-layer tree, and the next generation's four planes of "
              "128-port 400 Gbps two-layer trees.", ""]
    lines += _table(("design", "switches", "leaf", "spine/aggregation", "core", "endpoints", "capacity",
                     "cables", "oversubscription", "bisection Tbit/s", "within a zone Tbit/s"),
                    [(t.name, t.switches, t.leaf_switches, t.spine_switches, t.core_switches, t.endpoints,
                      t.endpoint_capacity, t.links, t.oversubscription, t.bisection_gbps / 1000,
                      t.zone_bisection_gbps / 1000) for t in designs])
    lines += ["", *[f"- {note}" for t in designs for note in t.notes]]
    leaves_per_zone = cluster.network.leaf_switches // cluster.network.zones
    placement = spread_placement(64, leaves_per_zone)
    lines += [f"- Placement: a 64-node job dealt round-robin over a zone's {leaves_per_zone} leaves uses "
              f"{len(set(placement))} leaves with at most {max(placement.count(x) for x in set(placement))} nodes "
              "on one, so its traffic spreads over the spines instead of one leaf's uplinks.", ""]

    # -- collectives -----------------------------------------------------------------------
    collective = cluster.collective
    dgx_collective = type(collective)(cluster.nodes["dgx_a100"])
    curves: dict[str, list[float]] = {"HFReduce": [], "HFReduce + NVLink": [], "NCCL (PCIe node)": [],
                                      "NCCL (DGX node)": []}
    table = []
    for gpus in GPU_COUNTS:
        values = [collective.hfreduce(gpus, FIG7A_MESSAGE_BYTES).algbw_gbs,
                  collective.hfreduce(gpus, FIG7A_MESSAGE_BYTES, nvlink=True).algbw_gbs,
                  collective.nccl(gpus, FIG7A_MESSAGE_BYTES).algbw_gbs,
                  dgx_collective.nccl(gpus, FIG7A_MESSAGE_BYTES).algbw_gbs]
        for name, value in zip(curves, values, strict=True):
            curves[name].append(value)
        table.append((gpus, *values, values[0] / values[2]))
    lines += ["## Allreduce bandwidth against GPUs (186 MiB)", ""]
    lines += _table(("GPUs", "HFReduce", "HFReduce + NVLink", "NCCL PCIe", "NCCL DGX", "HFReduce / NCCL"), table)
    bound = max(collective.hfreduce(64, FIG7A_MESSAGE_BYTES).bound, "")
    lines += ["", f"HFReduce on the PCIe node is bound by: {bound}; with NVLink by: "
              f"{collective.hfreduce(64, FIG7A_MESSAGE_BYTES, nvlink=True).bound}; NCCL by: "
              f"{collective.nccl(64, FIG7A_MESSAGE_BYTES).bound}.", ""]
    sizes = [1 << 20, 8 << 20, 64 << 20, 186 << 20, 1 << 30]
    lines += ["### Against message size (128 GPUs)", ""]
    lines += _table(("message MiB", "HFReduce GB/s", "NCCL GB/s"),
                    [(size >> 20, collective.hfreduce(128, size).algbw_gbs, collective.nccl(128, size).algbw_gbs)
                     for size in sizes])
    links = cluster.network.cross_zone_links
    port_gbs = cluster.network.port_gbps / 8
    lines += ["", "### Jobs across the two zones (512 GPUs each, HFReduce)", "",
              f"The zones are joined by {links} links ({links * port_gbs:.0f} GB/s each way; an assumption — the "
              "paper says only that they are few). An allreduce across the cut needs its own bandwidth in each "
              "direction; jobs that cross share the links.", ""]
    crossing = (1, 4, 16)
    link_counts = sorted({1, 2, 4, links} - {0})
    lines += _table(("cross-zone links", "inside a zone GB/s", *[f"{k} crossing job(s) GB/s" for k in crossing]),
                    [(n, collective.hfreduce(512, FIG7A_MESSAGE_BYTES).algbw_gbs,
                      *[collective.hfreduce(512, FIG7A_MESSAGE_BYTES, cross_zone_gbs=n * port_gbs / k).algbw_gbs
                        for k in crossing]) for n in link_counts])
    lines.append("")

    # -- training ---------------------------------------------------------------------------
    models = calibrated_models(cluster)
    scaling: dict[str, list[float]] = {}
    # As in the paper's experiments: VGG16 data parallel, GPT2-medium fully sharded, the two large
    # models pipeline parallel (with data parallelism across pipelines).
    setups: dict[str, dict[str, Any]] = {"vgg16": dict(strategy="dp"), "gpt2-medium": dict(strategy="fsdp"),
              "llama-13b": dict(strategy="pp", stages=8, micro_batches=32),
              "deepseekmoe-16b": dict(strategy="pp", stages=8, micro_batches=32)}
    lines += ["## Training step times and weak scaling (HFReduce unless stated)", ""]
    step_rows = []
    for name, setup in setups.items():
        spec = models[name]
        effs = []
        for gpus in GPU_COUNTS[1:]:
            job = TrainingJob(spec, cluster.node, gpus, **setup)
            effs.append(weak_scaling_efficiency(job, GPU_COUNTS[1]))
        scaling[f"{name} ({setup['strategy']})"] = effs
        for gpus in (64, 512):
            job = TrainingJob(spec, cluster.node, gpus, **setup)
            nccl = TrainingJob(spec, cluster.node, gpus, library="nccl", **setup)
            step_rows.append((name, setup["strategy"], gpus, job.step().compute_s, job.step().exposed_comm_s,
                              job.step().bubble_s, job.step().total_s, nccl.step().total_s))
    lines += _table(("model", "strategy", "GPUs", "compute s", "exposed comm s", "bubble s", "step s (HFReduce)",
                     "step s (NCCL)"), step_rows)
    lines += ["", "Weak scaling efficiency against 32 GPUs:", ""]
    lines += _table(("model", *[str(g) for g in GPU_COUNTS[1:]]), [(k, *v) for k, v in scaling.items()])
    strong_batches = {"vgg16": 8192, "gpt2-medium": 2048, "llama-13b": 4096, "deepseekmoe-16b": 4096}
    strong_rows = []
    for name, setup in setups.items():
        spec = models[name]
        strong: list[float | None] = []
        for gpus in GPU_COUNTS[1:]:
            job = TrainingJob(spec, cluster.node, gpus, **setup)
            try:
                strong.append(strong_scaling_efficiency(job, GPU_COUNTS[1], strong_batches[name]))
            except ConfigError:
                strong.append(None)
        strong_rows.append((f"{name} ({setup['strategy']}, {strong_batches[name]} samples)", *strong))
    lines += ["", "Strong scaling efficiency against 32 GPUs (fixed global batch):", ""]
    lines += _table(("model", *[str(g) for g in GPU_COUNTS[1:]]), strong_rows)
    moe = models["deepseekmoe-16b"]
    staggered = TrainingJob(moe, cluster.node, 512, strategy="pp", stages=8, micro_batches=32)
    packed = TrainingJob(moe, cluster.node, 512, strategy="pp", stages=8, micro_batches=32, staggered=False)
    lines += ["", f"Pipeline DP-rank placement (DeepSeekMoE-16B, 512 GPUs, 8 stages): staggered step "
              f"{staggered.step().total_s:.2f} s, not staggered {packed.step().total_s:.2f} s.", ""]
    vgg = models["vgg16"]
    lines += [f"VGG16's achieved GEMM fraction, calibrated from Fig. 8a's first HFReduce step: {vgg.mfu:.2f}.", ""]

    # -- storage ----------------------------------------------------------------------------
    storage = cluster.storage
    ckpt_gbs = cluster.checkpoint_write_gbs_per_node
    lines += ["## Storage (3FS)", "",
              f"{storage.storage_nodes} nodes x {storage.ssds_per_node} SSDs x {storage.ssd_tb} TB, "
              f"{storage.nics_per_node} x {storage.nic_gbps:.0f} Gbps NICs, {storage.replicas} replicas: "
              f"raw {storage.raw_capacity_pb:.1f} PB, usable {storage.usable_capacity_pb:.1f} PB; read "
              f"{storage.read_gbs() / 1000:.2f} TB/s of {storage.read_theoretical_gbs() / 1000:.2f} theoretical "
              f"(flow-control efficiency {storage.flow_control_efficiency:.3f}); write "
              f"{storage.write_gbs() / 1000:.2f} TB/s.", ""]
    ckpt_rows = []
    for name in ("gpt2-medium", "llama-13b", "deepseekmoe-16b"):
        spec = models[name]
        state = spec.params * CHECKPOINT_BYTES_PER_PARAM
        row: list[object] = [name, state / 1e9, storage.checkpoint_s(state, 64, ckpt_gbs),
                             storage.checkpoint_load_s(state, 64, cluster.node.nic_gbs * cluster.node.compute_nics)]
        if measured is not None:
            row.append(storage.checkpoint_s(state, 64, measured.write_gbs_per_node))
        ckpt_rows.append(row)
    header = ["model", "state GB", f"save s, 64 nodes at {ckpt_gbs:.1f} GB/s each", "load s, 64 nodes"]
    if measured is not None:
        header.append(f"save s at fs3's measured {measured.write_gbs_per_node:.2f} GB/s per node "
                      f"({Path(measured.source).name})")
    lines += [*_table(header, ckpt_rows), ""]
    lines += calibration_section(cluster, measured)

    # -- cost and energy --------------------------------------------------------------------
    ours = cluster.cost()
    designs_cost = [ours, dgx_cost]
    next_gen = Path(__file__).resolve().parent / "examples" / "four_plane_400g.toml"
    if next_gen.exists():
        designs_cost.append(load_cluster(next_gen).cost())
    lines += ["## Cost and energy", "",
              "Fire-Flyer 2, the same GPUs as DGX-A100 servers on a three-layer tree, and the next generation's "
              "four-plane 400 Gbps network (switch price and power assumed in `examples/four_plane_400g.toml`).", ""]
    lines += _table(("design", "GPUs", "servers", "network", "price", "power kW", "TF32 PFLOPS", "TFLOPS per price",
                     "TFLOPS per kW"),
                    [(c.name, c.gpus, c.server_price, c.network_price, c.price, c.power_kw, c.tflops / 1000,
                      c.tflops_per_price, c.tflops_per_kw) for c in designs_cost])
    lines += ["", f"Price PCIe / DGX: {ours.price / dgx_cost.price:.2f}; cost-performance (TF32 per price) PCIe / DGX: "
              f"{ours.tflops_per_price / dgx_cost.tflops_per_price:.2f}; energy-performance: "
              f"{ours.tflops_per_kw / dgx_cost.tflops_per_kw:.2f}.", ""]

    # -- failures ---------------------------------------------------------------------------
    failures = cluster.failures
    lines += ["## Failures", "",
              f"{failures.total:,} Xid errors in a year over {failures.gpus:,} GPUs: "
              f"{failures.per_gpu_day():.2e} interrupting Xids per GPU per day.", ""]
    llama = models["llama-13b"]
    fail_rows = []
    for gpus in (64, 256, 1024, 4096):
        nodes = max(1, gpus // cluster.node.gpus)
        ckpt = storage.checkpoint_s(llama.params * CHECKPOINT_BYTES_PER_PARAM, nodes, ckpt_gbs)
        interval = failures.optimal_interval_s(gpus, ckpt)
        fail_rows.append((gpus, failures.interruptions_per_day(gpus), failures.mtbi_s(gpus) / 3600, ckpt, interval,
                          failures.overhead(gpus, ckpt, interval)))
    lines += _table(("job GPUs", "interruptions/day", "MTBI h", "LLaMA-13B checkpoint s", "Young/Daly interval s",
                     "overhead"), fail_rows)
    lines += ["", "Xid counts: " + ", ".join(f"{x}: {c}" for x, c in sorted(failures.xid_counts.items())), ""]
    plots = PlotData(list(GPU_COUNTS), curves, list(GPU_COUNTS[1:]), scaling, ours, dgx_cost, failures.xid_counts)
    return "\n".join(lines), plots


def _plots(plots: PlotData, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in plots.allreduce.items():
        ax.plot(plots.gpus, values, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("allreduce bandwidth, GB/s (186 MiB)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "allreduce.png", dpi=110)
    plt.close(fig)
    written.append("allreduce.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in plots.scaling.items():
        ax.plot(plots.scaling_gpus, values, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("weak scaling efficiency vs 32 GPUs")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=110)
    plt.close(fig)
    written.append("scaling.png")
    ours, dgx = plots.ours, plots.dgx
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 4))
    names = [ours.name, dgx.name]
    left.bar(names, [ours.server_price, dgx.server_price], label="servers")
    left.bar(names, [ours.network_price, dgx.network_price], bottom=[ours.server_price, dgx.server_price],
             label="network")
    left.set_ylabel("price (relative)")
    left.legend()
    right.bar(names, [ours.power_kw, dgx.power_kw], color="tab:red")
    right.set_ylabel("power, kW")
    fig.tight_layout()
    fig.savefig(out / "cost_power.png", dpi=110)
    plt.close(fig)
    written.append("cost_power.png")
    xids = plots.xids
    fig, ax = plt.subplots(figsize=(7, 4))
    keys = sorted(xids)
    ax.bar([str(k) for k in keys], [max(xids[k], 0.5) for k in keys])
    ax.set_yscale("log")
    ax.set_xlabel("Xid")
    ax.set_ylabel("errors in a year")
    fig.tight_layout()
    fig.savefig(out / "xids.png", dpi=110)
    plt.close(fig)
    written.append("xids.png")
    return written


def write_report(cluster: Cluster, out: Path, measured: Measured | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    text, plots = render_report(cluster, measured)
    images = _plots(plots, out)
    if images:
        text += "\n## Plots\n\n" + "\n".join(f"![{Path(i).stem}]({i})" for i in images) + "\n"
    else:
        text += "\n(matplotlib is not installed: no plots.)\n"
    path = out / "report.md"
    path.write_text(text)
    return path


