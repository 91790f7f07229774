"""fs3's own measured write rate: one named, versioned input file.

The report sets the paper's checkpoint times beside those at the write rate fs3 itself reached. That
rate is read from one file, ``inputs/measured-v1.json``, so the report depends on that file alone and
not on which benchmark results happen to lie in ``bench/results``. The file is refreshed from a chosen
benchmark run with ``python -m cluster_model measured --from bench/results/<run>.json``, which records
the run and the figure the rate came from.

A missing file, one that is not JSON, one of another schema version or one without a positive rate is
refused with :class:`ConfigError` naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cluster_model.config import ConfigError

__all__ = ["DEFAULT_MEASURED", "SCHEMA_VERSION", "Measured", "load_measured", "measured_from_result",
           "write_measured"]

SCHEMA_VERSION = 1
"""Bumped (with the file name) whenever a field changes meaning, so an old file is refused, not misread."""

DEFAULT_MEASURED = Path(__file__).resolve().parent / "inputs" / f"measured-v{SCHEMA_VERSION}.json"

_BYTES_PER_MIB = 1 << 20


@dataclass(frozen=True)
class Measured:
    """One measured rate and where it came from."""

    write_gbs_per_node: float
    """fs3's sequential write rate, GB/s (10⁹ bytes per second), as one node reached it."""
    source: str
    """The benchmark result file the rate was read from (a path relative to the repository)."""
    metric: str
    """The figure in that file, as the slash-joined keys that lead to it."""


def load_measured(path: str | Path = DEFAULT_MEASURED) -> Measured:
    """The measured input at ``path``; refuses a missing, malformed or other-version file."""
    name = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(name, "no such file (python -m cluster_model measured --from RESULT writes it)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(name, f"not a readable JSON file: {exc}") from None
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
    return Measured(float(rate), source, metric)


def write_measured(measured: Measured, path: str | Path = DEFAULT_MEASURED) -> Path:
    """Writes ``measured`` as the input file at ``path`` (the current schema version)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"schema_version": SCHEMA_VERSION, "write_gbs_per_node": measured.write_gbs_per_node,
            "source": measured.source, "metric": measured.metric}
    out.write_text(json.dumps(body, indent=2) + "\n")
    return out


def measured_from_result(result: str | Path, source: str | None = None) -> Measured:
    """fs3's best sequential write rate in one benchmark result file.

    Any number whose keys mention ``fs3``, ``write`` and MiB/s counts (the peer comparison's big-file
    writes, the file and chunk benchmarks' write figures); the largest is taken. ``source`` is what the
    input records as its origin (default: ``result`` as given).
    """
    name = str(result)
    try:
        data = json.loads(Path(result).read_text())
    except FileNotFoundError:
        raise ConfigError(name, "no such benchmark result") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(name, f"not a readable JSON file: {exc}") from None
    rates = write_rates_mibps(data)
    if not rates:
        raise ConfigError(name, "holds no fs3 write rate in MiB/s")
    metric, mibps = max(rates, key=lambda item: item[1])
    return Measured(mibps * _BYTES_PER_MIB / 1e9, name if source is None else source, metric)


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
