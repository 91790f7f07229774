"""Failures from the Xid log, and how often a job should checkpoint.

Table VI counts a year of GPU Xid errors on the whole cluster; over its GPU count and a year they
become per-GPU rates, so a job of ``N`` GPUs sees ``N`` times the per-GPU rate (failures are taken
as independent and memoryless). Xid 63 (a page retirement recorded) does not stop a job; every
other Xid is counted as an interruption — the application-caused ones (13, 31, 43) too, since
they also end the run and send it back to its last checkpoint.

The checkpoint interval that minimises lost time is Young's ``sqrt(2·C·M)`` with Daly's
correction ``- C`` (``C``: checkpoint write time, ``M``: the job's mean time between
interruptions); the expected overhead is ``C/τ + τ/(2M)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster_model.config import ConfigError

__all__ = ["NON_INTERRUPTING_XIDS", "FailureModel"]

NON_INTERRUPTING_XIDS = frozenset({63})
_SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True)
class FailureModel:
    """Xid counts observed on ``gpus`` GPUs over ``days``, as rates and checkpoint advice."""

    xid_counts: dict[int, int]
    gpus: int
    days: float = 365.0

    def __post_init__(self) -> None:
        if self.gpus <= 0:
            raise ConfigError("failures.gpus", f"must be positive, not {self.gpus}")
        if self.days <= 0:
            raise ConfigError("failures.days", f"must be positive, not {self.days}")
        for xid, count in self.xid_counts.items():
            if count < 0:
                raise ConfigError(f"failures.xid_year.xid{xid}", f"must not be negative, not {count}")

    @classmethod
    def from_table(cls, table: dict[str, object], gpus: int) -> FailureModel:
        counts: dict[int, int] = {}
        for key, value in table.items():
            if key == "total":
                continue
            if not key.startswith("xid"):
                raise ConfigError(f"failures.xid_year.{key}", "keys are xidNN or xidNN_name")
            number = int(key[3:].split("_")[0])
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"failures.xid_year.{key}", f"must be a whole number, not {value!r}")
            counts[number] = counts.get(number, 0) + value
        total = table.get("total")
        if isinstance(total, int) and total != sum(counts.values()):
            raise ConfigError("failures.xid_year.total",
                              f"{total} is not the sum of the counts ({sum(counts.values())})")
        return cls(counts, gpus)

    @property
    def total(self) -> int:
        return sum(self.xid_counts.values())

    def per_gpu_day(self, xid: int | None = None) -> float:
        """Rate of Xid ``xid`` (None: every interrupting Xid) per GPU per day."""
        if xid is None:
            count = sum(c for x, c in self.xid_counts.items() if x not in NON_INTERRUPTING_XIDS)
        else:
            count = self.xid_counts.get(xid, 0)
        return count / self.gpus / self.days

    def interruptions_per_day(self, job_gpus: int) -> float:
        if job_gpus <= 0:
            raise ConfigError("job_gpus", f"must be positive, not {job_gpus}")
        return self.per_gpu_day() * job_gpus

    def mtbi_s(self, job_gpus: int) -> float:
        """The job's mean time between interruptions, in seconds."""
        return _SECONDS_PER_DAY / self.interruptions_per_day(job_gpus)

    def optimal_interval_s(self, job_gpus: int, checkpoint_s: float) -> float:
        """Young/Daly: ``sqrt(2·C·M) - C`` (never below ``C``)."""
        if checkpoint_s <= 0:
            raise ConfigError("checkpoint_s", f"must be positive, not {checkpoint_s}")
        mtbi = self.mtbi_s(job_gpus)
        return max(checkpoint_s, math.sqrt(2 * checkpoint_s * mtbi) - checkpoint_s)

    def overhead(self, job_gpus: int, checkpoint_s: float, interval_s: float) -> float:
        """Fraction of time lost to writing checkpoints and redoing work after interruptions."""
        if interval_s <= 0:
            raise ConfigError("interval_s", f"must be positive, not {interval_s}")
        return checkpoint_s / interval_s + interval_s / (2 * self.mtbi_s(job_gpus))

