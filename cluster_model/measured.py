"""What was measured on this machine: one named, versioned input file.

The report sets the paper's checkpoint times beside those at the write rate fs3 itself reached, and
sets the model's predictions for this machine beside HFReduce's and HaiScale's measured results here
(its calibration at the small end of the scale). Everything it reads of those runs comes from one
file, ``inputs/measured-v2.json``, so the report depends on that file alone and not on which benchmark
results happen to lie in ``bench/results``. The file is written from chosen benchmark runs with
``python -m cluster_model measured --from A.json [--from B.json ...]``:

* a result holding fs3 write rates in MiB/s (peers, file, chunk benchmarks) gives ``write_gbs_per_node``
  (exactly one such result is needed);
* an HFReduce result (``kind`` ``hfreduce-allreduce``, ``bench/hfreduce_bench.py``) gives this machine's
  figures (cores, all-core memory and copy bandwidth) and the allreduce cells;
* a HaiScale DDP result (``kind`` ``haiscale-ddp-step``, ``bench/haiscale_ddp_bench.py``) gives the
  DDP step cells.

Every figure records the result file it came from. A missing file, one that is not JSON, one of another
schema version, or a result without a field the model needs is refused with :class:`ConfigError` naming
the file and the field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster_model.config import ConfigError

__all__ = ["DEFAULT_MEASURED", "SCHEMA_VERSION", "AllreduceCell", "DdpCell", "Machine", "Measured", "load_measured",
           "measured_from_result", "measured_from_results", "write_measured"]

SCHEMA_VERSION = 2
"""Bumped (with the file name) whenever a field changes meaning, so an old file is refused, not misread.
Version 2 added this machine's figures and the HFReduce and DDP cells to version 1's write rate."""

DEFAULT_MEASURED = Path(__file__).resolve().parent / "inputs" / f"measured-v{SCHEMA_VERSION}.json"

_BYTES_PER_MIB = 1 << 20
_HFREDUCE_KIND = "hfreduce-allreduce"
_DDP_KIND = "haiscale-ddp-step"
_RESULT_VERSION = 1  # format_version of the HFReduce and DDP results this reader understands


@dataclass(frozen=True)
class Machine:
    """The machine the HFReduce benchmark ran on, as that run measured it."""

    cores: int
    memory_bw_gbs: float
    """All-core memory bandwidth, read plus written bytes per second, GB/s (the best of copy and add)."""
    copy_bw_gbs: float
    """All-core copy bandwidth, read plus written bytes per second, GB/s."""
    source: str


@dataclass(frozen=True)
class AllreduceCell:
    """One HFReduce allreduce measurement: ``nodes`` x ``ranks_per_node`` ranks, one float32 tensor."""

    nodes: int
    ranks_per_node: int
    size_bytes: int
    hfreduce_algbw_gbs: float
    gloo_algbw_gbs: float
    traffic_bytes_per_byte: float
    """The benchmark's own count of memory bytes read plus written per byte (its ``traffic_model``)."""
    source: str

    @property
    def layout(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node}"


@dataclass(frozen=True)
class DdpCell:
    """One DDP step measurement: the same training step alone (local), on HaiScale and on torch's DDP."""

    nodes: int
    ranks_per_node: int
    model: str
    parameters: int
    local_step_s: float
    """Every rank computing the step at once with no communication: the compute."""
    haiscale_step_s: float
    torch_step_s: float
    source: str

    @property
    def layout(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node}"


@dataclass(frozen=True)
class Measured:
    """What was measured here and where it came from."""

    write_gbs_per_node: float
    """fs3's sequential write rate, GB/s (10⁹ bytes per second), as one node reached it."""
    source: str
    """The benchmark result file the rate was read from (a path relative to the repository)."""
    metric: str
    """The figure in that file, as the slash-joined keys that lead to it."""
    machine: Machine | None = None
    allreduce: tuple[AllreduceCell, ...] = ()
    ddp: tuple[DdpCell, ...] = ()


# -- field checks --------------------------------------------------------------------------------------


def _number(table: dict[str, Any], key: str, where: str) -> float:
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{where}.{key}", f"must be a positive number, not {value!r}")
    return float(value)


def _count(table: dict[str, Any], key: str, where: str) -> int:
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}.{key}", f"must be a positive whole number, not {value!r}")
    return value


def _text(table: dict[str, Any], key: str, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}.{key}", f"must be a non-empty string, not {value!r}")
    return value


def _objects(table: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ConfigError(f"{where}.{key}", "must be a list of objects")
    return value


def _read_json(path: str | Path, missing: str) -> Any:
    name = str(path)
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(name, missing) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(name, f"not a readable JSON file: {exc}") from None


# -- the input file -------------------------------------------------------------------------------------


def load_measured(path: str | Path = DEFAULT_MEASURED) -> Measured:
    """The measured input at ``path``; refuses a missing, malformed or other-version file."""
    name = str(path)
    data = _read_json(path, "no such file (python -m cluster_model measured --from RESULT writes it)")
    if not isinstance(data, dict):
        raise ConfigError(name, "must hold a JSON object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ConfigError(f"{name}: schema_version", f"this model reads version {SCHEMA_VERSION}, not {version!r}")
    rate = data.get("write_gbs_per_node")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise ConfigError(f"{name}: write_gbs_per_node", f"must be a positive number, not {rate!r}")
    source, metric = data.get("source"), data.get("metric")
    if not isinstance(source, str) or not source:
        raise ConfigError(f"{name}: source", "must name the benchmark result the rate came from")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"{name}: metric", "must name the figure in that result")
    machine = None
    raw_machine = data.get("machine")
    if raw_machine is not None:
        if not isinstance(raw_machine, dict):
            raise ConfigError(f"{name}: machine", "must be an object or null")
        where = f"{name}: machine"
        machine = Machine(_count(raw_machine, "cores", where), _number(raw_machine, "memory_bw_gbs", where),
                          _number(raw_machine, "copy_bw_gbs", where), _text(raw_machine, "source", where))
    allreduce = []
    for index, cell in enumerate(_objects(data, "allreduce", name)):
        where = f"{name}: allreduce[{index}]"
        allreduce.append(AllreduceCell(
            _count(cell, "nodes", where), _count(cell, "ranks_per_node", where), _count(cell, "size_bytes", where),
            _number(cell, "hfreduce_algbw_gbs", where), _number(cell, "gloo_algbw_gbs", where),
            _number(cell, "traffic_bytes_per_byte", where), _text(cell, "source", where)))
    ddp = []
    for index, cell in enumerate(_objects(data, "ddp", name)):
        where = f"{name}: ddp[{index}]"
        ddp.append(DdpCell(
            _count(cell, "nodes", where), _count(cell, "ranks_per_node", where), _text(cell, "model", where),
            _count(cell, "parameters", where), _number(cell, "local_step_s", where),
            _number(cell, "haiscale_step_s", where), _number(cell, "torch_step_s", where),
            _text(cell, "source", where)))
    if (allreduce or ddp) and machine is None:
        raise ConfigError(f"{name}: machine", "cells need the machine they were measured on")
    return Measured(float(rate), source, metric, machine, tuple(allreduce), tuple(ddp))


def write_measured(measured: Measured, path: str | Path = DEFAULT_MEASURED) -> Path:
    """Writes ``measured`` as the input file at ``path`` (the current schema version)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = measured.machine
    body = {"schema_version": SCHEMA_VERSION, "write_gbs_per_node": measured.write_gbs_per_node,
            "source": measured.source, "metric": measured.metric,
            "machine": None if machine is None else {
                "cores": machine.cores, "memory_bw_gbs": machine.memory_bw_gbs,
                "copy_bw_gbs": machine.copy_bw_gbs, "source": machine.source},
            "allreduce": [{"nodes": c.nodes, "ranks_per_node": c.ranks_per_node, "size_bytes": c.size_bytes,
                           "hfreduce_algbw_gbs": c.hfreduce_algbw_gbs, "gloo_algbw_gbs": c.gloo_algbw_gbs,
                           "traffic_bytes_per_byte": c.traffic_bytes_per_byte, "source": c.source}
                          for c in measured.allreduce],
            "ddp": [{"nodes": c.nodes, "ranks_per_node": c.ranks_per_node, "model": c.model,
                     "parameters": c.parameters, "local_step_s": c.local_step_s,
                     "haiscale_step_s": c.haiscale_step_s, "torch_step_s": c.torch_step_s, "source": c.source}
                    for c in measured.ddp]}
    out.write_text(json.dumps(body, indent=2) + "\n")
    return out


# -- benchmark results ----------------------------------------------------------------------------------


def measured_from_result(result: str | Path, source: str | None = None) -> Measured:
    """fs3's best sequential write rate in one benchmark result file.

    Any number whose keys mention ``fs3``, ``write`` and MiB/s counts (the peer comparison's big-file
    writes, the file and chunk benchmarks' write figures); the largest is taken. ``source`` is what the
    input records as its origin (default: ``result`` as given).
    """
    name = str(result)
    data = _read_json(result, "no such benchmark result")
    rates = write_rates_mibps(data)
    if not rates:
        raise ConfigError(name, "holds no fs3 write rate in MiB/s")
    metric, mibps = max(rates, key=lambda item: item[1])
    return Measured(mibps * _BYTES_PER_MIB / 1e9, name if source is None else source, metric)


def _versioned(data: object, name: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(name, "must hold a JSON object")
    if data.get("format_version") != _RESULT_VERSION:
        raise ConfigError(f"{name}: format_version",
                          f"this model reads version {_RESULT_VERSION}, not {data.get('format_version')!r}")
    return data


def _hfreduce_result(data: dict[str, Any], name: str, source: str) -> tuple[Machine, list[AllreduceCell]]:
    raw = data.get("machine")
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: machine", "must be an object")
    where = f"{name}: machine"
    machine = Machine(_count(raw, "cores", where), _number(raw, "memory_bandwidth_bytes_per_s", where) / 1e9,
                      _number(raw, "copy_bytes_per_s", where) / 1e9, source)
    cells = []
    for index, cell in enumerate(_objects(data, "cells", name)):
        where = f"{name}: cells[{index}]"
        cells.append(AllreduceCell(
            _count(cell, "nodes", where), _count(cell, "ranks_per_node", where), _count(cell, "size_bytes", where),
            _number(cell, "hfreduce_algbw_bytes_per_s", where) / 1e9,
            _number(cell, "gloo_algbw_bytes_per_s", where) / 1e9,
            _number(cell, "traffic_bytes_per_byte", where), source))
    if not cells:
        raise ConfigError(f"{name}: cells", "holds no allreduce cell")
    return machine, cells


def _ddp_result(data: dict[str, Any], name: str, source: str) -> list[DdpCell]:
    cells = []
    for index, cell in enumerate(_objects(data, "cells", name)):
        where = f"{name}: cells[{index}]"
        cells.append(DdpCell(
            _count(cell, "nodes", where), _count(cell, "ranks_per_node", where), _text(cell, "model", where),
            _count(cell, "parameters", where), _number(cell, "local_step_s", where),
            _number(cell, "haiscale_step_s", where), _number(cell, "torch_step_s", where), source))
    if not cells:
        raise ConfigError(f"{name}: cells", "holds no DDP cell")
    return cells


def measured_from_results(results: Sequence[str | Path], sources: Sequence[str] | None = None) -> Measured:
    """The input file's contents from named benchmark results (one write-rate result, at most one HFReduce
    result, any number of DDP results); ``sources`` are what the input records as their origins."""
    if not results:
        raise ConfigError("--from", "name at least one benchmark result")
    names = [str(r) for r in results] if sources is None else list(sources)
    if len(names) != len(results):
        raise ConfigError("sources", "one per result")
    write: Measured | None = None
    machine: Machine | None = None
    allreduce: list[AllreduceCell] = []
    ddp: list[DdpCell] = []
    for result, source in zip(results, names, strict=True):
        name = str(result)
        data = _read_json(result, "no such benchmark result")
        kind = data.get("kind") if isinstance(data, dict) else None
        if kind == _HFREDUCE_KIND:
            if machine is not None:
                raise ConfigError(name, f"a second HFReduce result (the first: {machine.source})")
            machine, cells = _hfreduce_result(_versioned(data, name), name, source)
            allreduce += cells
        elif kind == _DDP_KIND:
            ddp += _ddp_result(_versioned(data, name), name, source)
        else:
            rate = measured_from_result(result, source)
            if write is not None:
                raise ConfigError(name, f"a second fs3 write-rate result (the first: {write.source})")
            write = rate
    if write is None:
        raise ConfigError("--from", "no result named holds an fs3 write rate in MiB/s")
    if ddp and machine is None:
        raise ConfigError("--from", "DDP cells need the HFReduce result that measured this machine")
    return Measured(write.write_gbs_per_node, write.source, write.metric, machine, tuple(allreduce), tuple(ddp))


def write_rates_mibps(data: object) -> list[tuple[str, float]]:
    """Every fs3 write figure in MiB/s anywhere in a result, with the slash-joined keys that lead to it."""
    rates: list[tuple[str, float]] = []

    def walk(node: object, path: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, (*path, str(key)))
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            joined = "/".join(path)
            lowered = joined.lower()
            if "fs3" in lowered and "write" in lowered and "mib" in lowered and node > 0:
                rates.append((joined, float(node)))

    walk(data, ())
    return rates
