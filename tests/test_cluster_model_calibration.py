"""The model at the small end: the generalised host-memory count, this machine as a node, and the
model against HFReduce's and HaiScale's results measured here (``cluster_model/inputs/measured-v2.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.hfreduce_bench import Layout, traffic_bytes_per_byte
from cluster_model.__main__ import main
from cluster_model.calibration import (
    calibration_rows,
    calibration_section,
    exposed_allreduce_s,
    machine_node,
    predicted_allreduce,
)
from cluster_model.cluster import Cluster, load_cluster
from cluster_model.collectives import HOST_MEMORY_OPS_PER_BYTE, Collective, host_memory_bytes_per_byte
from cluster_model.config import ConfigError
from cluster_model.measured import (
    DEFAULT_MEASURED,
    Machine,
    Measured,
    load_measured,
    measured_from_results,
    write_measured,
)
from cluster_model.node import Node
from cluster_model.report import render_report
from hfreduce.tree import double_binary_tree

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
#: Model / measured is held within this factor for pipelined allreduces (16 chunks or more) and DDP steps.
#: Why 2.5: a factor of 2 for what the model leaves out — more processes than the 2 cores taking turns,
#: Python, futex wake-ups, TCP's per-segment work, other load on the shared machine (load averages of 6
#: to 13 recorded by the DDP runs) — which on a machine this small can take as long as the copies
#: themselves; times 1.25, the spread the measurement itself shows between message sizes of one layout
#: (3x2: 0.205 GB/s at 64 MiB, 0.257 at 256 MiB) where the pipelined model predicts within a few percent.
FACTOR = 2.5


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return load_cluster()


@pytest.fixture(scope="module")
def measured() -> Measured:
    return load_measured()


def _tree_positions_with_children(nodes: int) -> int:
    return sum(1 for node in range(nodes) for position in double_binary_tree(nodes, node) if position.children)


# -- the generalised host-memory count -------------------------------------------------------------


@pytest.mark.parametrize("nodes", [2, 3, 16, 180])
def test_the_paper_node_moves_24_bytes_per_byte_and_the_old_nvlink_count(nodes: int) -> None:
    assert host_memory_bytes_per_byte(8, nodes) == 24 == HOST_MEMORY_OPS_PER_BYTE
    # NVLink: pairs reduce first, four buffers: one D2H write and one reduce read fewer per buffer.
    assert host_memory_bytes_per_byte(4, nodes) == 24 - 4 * 2
    # One node sends nothing: the network's 2 reads, 2 writes and 1 read are gone.
    assert host_memory_bytes_per_byte(8, 1) == 19


@pytest.mark.parametrize("ranks", range(1, 9))
def test_one_node_of_host_ranks_counts_what_the_benchmark_counts(ranks: int) -> None:
    assert host_memory_bytes_per_byte(ranks, 1, ranks_in_host_memory=True) == 5 * ranks - 1
    assert traffic_bytes_per_byte(Layout(1, ranks)) == 5 * ranks - 1


@pytest.mark.parametrize(("nodes", "ranks"), [(2, 2), (3, 2), (2, 4), (4, 2), (5, 3)])
def test_namespace_nodes_count_what_the_benchmark_counts_less_the_own_partial(nodes: int, ranks: int) -> None:
    model = host_memory_bytes_per_byte(ranks, nodes, ranks_in_host_memory=True, nodes_share_memory=True,
                                       socket_network=True)
    # By hand: N(5L-1) + sockets 2 x (2(N-1) sent + 2(N-1) received) + (N-1) children's partials read.
    assert model == nodes * (5 * ranks - 1) + 9 * (nodes - 1)
    # The benchmark also counts, per tree position with children, its own partial read and the sum written
    # (half the bytes each); the paper's 24 does not, and the model keeps the paper's count.
    assert traffic_bytes_per_byte(Layout(nodes, ranks)) == model + _tree_positions_with_children(nodes)


def test_sockets_and_shared_memory_only_add_traffic() -> None:
    for nodes in (2, 3, 8):
        dma = host_memory_bytes_per_byte(2, nodes, ranks_in_host_memory=True)
        socket = host_memory_bytes_per_byte(2, nodes, ranks_in_host_memory=True, socket_network=True)
        shared = host_memory_bytes_per_byte(2, nodes, ranks_in_host_memory=True, nodes_share_memory=True,
                                            socket_network=True)
        assert dma < socket <= shared


@pytest.mark.parametrize(("buffers", "nodes", "host", "field"), [
    (0, 2, False, "buffers"), (-1, 2, False, "buffers"), (0.5, 1, True, "buffers"), (True, 1, True, "buffers"),
    (8, 0, False, "nodes"), (8, 1.5, False, "nodes"), (8, True, False, "nodes"),
])
def test_the_count_refuses_impossible_layouts(buffers: Any, nodes: Any, host: bool, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        host_memory_bytes_per_byte(buffers, nodes, ranks_in_host_memory=host)


# -- this machine as a node ------------------------------------------------------------------------


def test_the_paper_figures_are_unchanged_by_the_generalised_count(cluster: Cluster) -> None:
    collective = cluster.collective
    assert collective.hfreduce_bound_gbs() == pytest.approx(320 / 24)
    for gpus in (16, 32, 64):
        assert collective.hfreduce(gpus, 186 * MIB).bound == "intra-node copy and reduce"


def test_more_ranks_on_two_cores_never_raise_the_predicted_rate(cluster: Cluster, measured: Measured) -> None:
    machine = measured.machine
    assert machine is not None and machine.cores == 2
    for size in (1 * MIB, 64 * MIB, 256 * MIB):
        by_ranks = [predicted_allreduce(cluster, machine, 1, ranks, size).algbw_gbs for ranks in range(1, 9)]
        assert by_ranks == sorted(by_ranks, reverse=True), size
        by_nodes = [predicted_allreduce(cluster, machine, nodes, 2, size).algbw_gbs for nodes in range(1, 7)]
        assert by_nodes == sorted(by_nodes, reverse=True), size
        assert all(rate > 0 for rate in by_ranks + by_nodes)


def test_the_host_rank_chain_by_hand(cluster: Cluster) -> None:
    machine = Machine(cores=2, memory_bw_gbs=20.0, copy_bw_gbs=16.0, source="x")
    result = predicted_allreduce(cluster, machine, 1, 2, 256 * MIB)
    # Copy-in by one rank on one core (2 B at 8 GB/s), reduce on both (3 B at 20), copy-out on both (4 B at 16).
    per_byte_s = (2 / 8 + 3 / 20 + 4 / 16) / 1e9
    assert result.bound == "intra-node copy and reduce"
    assert result.time_s == pytest.approx(256 * MIB * per_byte_s)
    # The chain is never faster than all its traffic at the full memory bandwidth.
    for nodes, ranks in ((1, 2), (1, 4), (2, 2), (3, 2)):
        traffic = host_memory_bytes_per_byte(ranks, nodes, ranks_in_host_memory=True, nodes_share_memory=True,
                                             socket_network=True)
        assert predicted_allreduce(cluster, machine, nodes, ranks, 256 * MIB).algbw_gbs <= 20.0 / traffic * 1.0001


@pytest.mark.parametrize(("ranks", "cores", "memory", "copy", "field"), [
    (0, 2, 1.0, 1.0, "ranks_per_node"), (2, 0, 1.0, 1.0, "cores"), (2, 2.5, 1.0, 1.0, "cores"),
    (2, 2, 0.0, 1.0, "memory_bw_gbs"), (2, 2, 1.0, -1.0, "copy_bw_gbs"), (2, 2, 1.0, True, "copy_bw_gbs"),
])
def test_host_rank_nodes_refuse_bad_figures(ranks: Any, cores: Any, memory: Any, copy: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        Node.host_ranks("here", ranks, cores, memory, copy)


def test_a_paper_node_has_no_host_rank_chain(cluster: Cluster) -> None:
    from cluster_model.collectives import host_rank_chain_s_per_byte

    with pytest.raises(ConfigError, match="host-rank chain"):
        host_rank_chain_s_per_byte(cluster.node, 8, 2)
    assert Collective(machine_node(Machine(2, 20.0, 16.0, "x"), 2)).hfreduce(2, MIB).time_s > 0


# -- the DDP overlap rule ----------------------------------------------------------------------------


def test_busy_cores_hide_nothing_idle_ones_follow_the_paper_rule() -> None:
    assert exposed_allreduce_s(0.3, 0.05, 1.0, 0.0) == 0.3
    assert exposed_allreduce_s(0.3, 0.05, 1.0, 1.0) == pytest.approx(0.05)            # hidden but the last bucket
    assert exposed_allreduce_s(0.3, 0.05, 0.2, 1.0) == pytest.approx(0.1 + 0.05)      # the excess too
    assert exposed_allreduce_s(0.3, 0.05, 0.4, 0.5) == pytest.approx(0.1 + 0.05)      # half the window
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="idle_core_share"):
            exposed_allreduce_s(0.3, 0.05, 1.0, bad)


# -- model against measurement -------------------------------------------------------------------------


def test_model_and_measurement_agree_within_the_stated_factor(cluster: Cluster, measured: Measured) -> None:
    rows = calibration_rows(cluster, measured)
    assert len(rows) == len(measured.allreduce) + len(measured.ddp) >= 20
    for row, cell in zip(rows, measured.allreduce, strict=False):
        assert row.measured == cell.hfreduce_algbw_gbs
        if cell.size_bytes >= 16 * MIB:  # pipelined: what the paper-scale model is about
            assert 1 / FACTOR <= row.model_over_measured <= FACTOR, (row.setup, row.model_over_measured)
        elif cell.nodes == 1:
            # One chunk on one node: the per-operation costs the model lacks only add time.
            assert row.model_over_measured >= 1, row.setup
    for row in rows[len(measured.allreduce):]:
        assert 1 / FACTOR <= row.model_over_measured <= FACTOR, (row.setup, row.model_over_measured)
        assert "all exposed" in row.mechanism


def test_the_report_sets_model_beside_measurement_after_storage(cluster: Cluster, measured: Measured) -> None:
    text, _ = render_report(cluster, measured)
    storage, calibration, cost = (text.index(h) for h in ("## Storage (3FS)", "## Calibration on this machine",
                                                          "## Cost and energy"))
    assert storage < calibration < cost
    assert "| HFReduce allreduce bandwidth | 2x2, 64 MiB |" in text and "| HaiScale DDP step | 1x4, mlp" in text
    assert "Where they differ" in text
    assert calibration_section(cluster, None) == []
    bare = Measured(1.0, "r.json", "m")
    assert "nothing to calibrate" in "\n".join(calibration_section(cluster, bare))
    assert "## Calibration" not in render_report(cluster)[0]


# -- the input file ----------------------------------------------------------------------------------


def test_the_committed_input_loads_and_is_rewritten_from_its_sources(measured: Measured, tmp_path: Path) -> None:
    assert DEFAULT_MEASURED.name == "measured-v2.json"
    assert not (DEFAULT_MEASURED.parent / "measured-v1.json").exists()
    machine = measured.machine
    assert machine is not None and machine.cores == 2 and machine.memory_bw_gbs > 0
    assert {c.layout for c in measured.allreduce} == {"1x2", "1x4", "2x2", "3x2"}
    assert {(c.layout, c.model) for c in measured.ddp} == {("1x4", "mlp"), ("1x4", "gpt"), ("2x2", "mlp"),
                                                           ("2x2", "gpt")}
    sources = [measured.source, machine.source, measured.ddp[0].source]
    assert all((ROOT / s).exists() for s in sources)
    assert measured_from_results([ROOT / s for s in sources], sources) == measured
    out = tmp_path / "measured-v2.json"
    assert main(["measured", *(a for s in sources for a in ("--from", str(ROOT / s))), "--out", str(out)]) == 0
    again = load_measured(out)
    assert (again.allreduce, again.ddp) == (measured.allreduce, measured.ddp)
    assert write_measured(measured, tmp_path / "copy.json") and load_measured(tmp_path / "copy.json") == measured


def _committed() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DEFAULT_MEASURED.read_text())
    return data


@pytest.mark.parametrize(("change", "field"), [
    (lambda d: d.update(schema_version=1), "schema_version"),
    (lambda d: d["machine"].pop("cores"), "machine.cores"),
    (lambda d: d["machine"].update(memory_bw_gbs=0), "machine.memory_bw_gbs"),
    (lambda d: d.update(machine=[1]), "machine"),
    (lambda d: d.update(machine=None), "machine"),
    (lambda d: d["allreduce"][3].pop("hfreduce_algbw_gbs"), r"allreduce\[3\].hfreduce_algbw_gbs"),
    (lambda d: d["allreduce"][0].update(nodes=1.5), r"allreduce\[0\].nodes"),
    (lambda d: d.update(allreduce={}), "allreduce"),
    (lambda d: d["ddp"][1].update(local_step_s=-1), r"ddp\[1\].local_step_s"),
    (lambda d: d["ddp"][0].update(source=""), r"ddp\[0\].source"),
])
def test_a_bad_input_file_is_refused_naming_the_field(tmp_path: Path, change: Any, field: str) -> None:
    body = _committed()
    change(body)
    path = tmp_path / "measured-v2.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=field):
        load_measured(path)


def _results(tmp_path: Path) -> dict[str, Path]:
    measured = load_measured()
    assert measured.machine is not None
    names = {"write": measured.source, "hfreduce": measured.machine.source, "ddp": measured.ddp[0].source}
    return {key: ROOT / name for key, name in names.items()}


@pytest.mark.parametrize(("which", "change", "field"), [
    ("hfreduce", lambda d: d.update(format_version=2), "format_version"),
    ("hfreduce", lambda d: d["machine"].pop("copy_bytes_per_s"), "machine.copy_bytes_per_s"),
    ("hfreduce", lambda d: d.update(cells=[]), "cells"),
    ("hfreduce", lambda d: d["cells"][2].pop("gloo_algbw_bytes_per_s"), r"cells\[2\].gloo_algbw_bytes_per_s"),
    ("ddp", lambda d: d["cells"][0].pop("local_step_s"), r"cells\[0\].local_step_s"),
    ("ddp", lambda d: d["cells"][1].update(parameters="many"), r"cells\[1\].parameters"),
    ("ddp", lambda d: d.update(format_version=None), "format_version"),
])
def test_a_result_without_the_needed_fields_is_refused(tmp_path: Path, which: str, change: Any, field: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    paths = _results(tmp_path)
    body = json.loads(paths[which].read_text())
    change(body)
    broken = tmp_path / f"{which}.json"
    broken.write_text(json.dumps(body))
    paths[which] = broken
    with pytest.raises(ConfigError, match=field) as raised:
        measured_from_results(list(paths.values()))
    assert str(broken) in str(raised.value)
    out = tmp_path / "m.json"
    assert main(["measured", *(a for p in paths.values() for a in ("--from", str(p))), "--out", str(out)]) == 2
    assert field.replace("\\", "") in capsys.readouterr().err and not out.exists()


def test_a_missing_duplicate_or_lonely_result_is_refused(tmp_path: Path) -> None:
    paths = _results(tmp_path)
    with pytest.raises(ConfigError, match="no such benchmark result"):
        measured_from_results([paths["write"], tmp_path / "gone.json"])
    with pytest.raises(ConfigError, match="second HFReduce"):
        measured_from_results([paths["write"], paths["hfreduce"], paths["hfreduce"]])
    with pytest.raises(ConfigError, match="second fs3 write-rate"):
        measured_from_results([paths["write"], paths["write"]])
    with pytest.raises(ConfigError, match="need the HFReduce result"):
        measured_from_results([paths["write"], paths["ddp"]])
    with pytest.raises(ConfigError, match="no result named holds an fs3 write rate"):
        measured_from_results([paths["hfreduce"]])
    with pytest.raises(ConfigError, match="at least one"):
        measured_from_results([])
