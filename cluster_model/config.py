"""Loading and checking cluster descriptions (TOML).

Every number the model uses comes from a TOML file: the paper's reference figures
(``../shared/reference/fire_flyer_2.toml`` or a copy under ``cluster_model/data``) or a what-if
file that overrides some of them. Bad values are refused with :class:`ConfigError`, which names
the dotted path of the field (``node.pcie_a100.nic_gbps``) so the file can be fixed.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "deep_merge", "load_toml", "reference_path", "require_int", "require_number"]

_PACKAGE_DATA = Path(__file__).resolve().parent / "data" / "fire_flyer_2.toml"
_SHARED = Path(__file__).resolve().parents[2] / "shared" / "reference" / "fire_flyer_2.toml"


class ConfigError(ValueError):
    """A cluster description that the model cannot use; ``field`` is the dotted path at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def reference_path() -> Path:
    """The paper's reference figures: the shared copy when present, else the packaged one."""
    return _SHARED if _SHARED.exists() else _PACKAGE_DATA


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(str(path), "no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from None


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` laid over it, table by table (neither is modified)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def require_number(table: dict[str, Any], key: str, field: str, *, positive: bool = True,
                   default: float | None = None, allow_zero: bool = False) -> float:
    """``table[key]`` as a float; refuses a missing, non-numeric, negative or (unless allowed) zero value."""
    value = table.get(key, default)
    path = f"{field}.{key}"
    if value is None:
        raise ConfigError(path, "missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(path, f"must be a number, not {value!r}")
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        raise ConfigError(path, f"must be {'non-negative' if allow_zero else 'positive'}, not {value}")
    return float(value)


def require_int(table: dict[str, Any], key: str, field: str, *, minimum: int = 1, default: int | None = None) -> int:
    value = table.get(key, default)
    path = f"{field}.{key}"
    if value is None:
        raise ConfigError(path, "missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"must be a whole number, not {value!r}")
    if value < minimum:
        raise ConfigError(path, f"must be at least {minimum}, not {value}")
    return value
