"""The docker-compose topology, read the way compose reads it, for tests that run it elsewhere."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SERVER_SERVICES = ["mgmtd", "meta", "storage1", "storage2", "storage3"]


def _interpolate(value: str, env: dict[str, str]) -> str:
    """``${VAR:-default}`` and ``${VAR:?message}`` (required: compose refuses to start without it)."""
    def required(match: re.Match[str]) -> str:
        if not env.get(match.group(1)):
            raise ValueError(f"{match.group(1)}: {match.group(2)}")
        return env[match.group(1)]

    value = re.sub(r"\$\{(\w+):\?([^}]*)\}", required, value)
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), value)


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml with anchors merged and ``${VAR:-default}``/``${VAR:?message}`` resolved in
    environments (``env`` as compose's environment: FS3_TOKEN is required)."""
    import yaml

    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    env = env or {}
    for service in data["services"].values():
        service["environment"] = {k: _interpolate(str(v), env) for k, v in (service.get("environment") or {}).items()}
    return data


def service_address(compose: dict[str, Any], name: str) -> str:
    """``name:port`` as other services reach it (its framed port)."""
    env = compose["services"][name]["environment"]
    return f"{name}:{next(v for k, v in env.items() if k.endswith('_FRAMED_PORT'))}"
