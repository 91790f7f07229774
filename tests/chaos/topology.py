"""The docker-compose topology, read the way compose reads it, for tests that run it elsewhere."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SERVER_SERVICES = ["mgmtd", "meta", "storage1", "storage2", "storage3"]
# The `ha` profile's servers, in start order: PostgreSQL, three mgmtd, three meta, three storage.
HA_SERVER_SERVICES = ["postgres", "ha-mgmtd1", "ha-mgmtd2", "ha-mgmtd3", "ha-meta1", "ha-meta2", "ha-meta3",
                      "ha-storage1", "ha-storage2", "ha-storage3"]
POSTGRES_PORT = "5432"  # the official image's


@dataclass(frozen=True)
class Profile:
    """One compose topology: its servers (start order), the one-shot setup and the client service."""

    servers: list[str]
    setup: str
    client: str


PROFILES = {"default": Profile(SERVER_SERVICES, "setup", "client"),
            "ha": Profile(HA_SERVER_SERVICES, "ha-setup", "ha-client")}

# $$ (a literal $), ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}, $VAR.
_VARIABLE = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?)([-?])([^}]*))?\}|(\w+))")


def _interpolate(value: str, env: dict[str, str]) -> str:
    """One string as compose interpolates it: with ``:`` an empty variable counts as unset; ``?``
    makes a variable required (compose refuses to start without it)."""
    def substitute(match: re.Match[str]) -> str:
        dollar, name, colon, kind, arg, bare = match.groups()
        if dollar:
            return "$"
        if bare:
            return env.get(bare, "")
        unset = name not in env or (colon == ":" and not env[name])
        if kind == "?" and unset:
            raise ValueError(f"{name}: {arg}")
        if kind == "-" and unset:
            return str(arg)
        return env.get(name, "")

    return _VARIABLE.sub(substitute, value)


def _interpolate_all(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return _interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_all(v, env) for v in node]
    if isinstance(node, dict):
        return {k: _interpolate_all(v, env) for k, v in node.items()}
    return node


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml with anchors merged and every value interpolated as compose does
    (``env`` as compose's environment: FS3_TOKEN is required, FS3_PUBLIC_HOST optional);
    environments as ``{name: str}``."""
    import yaml

    data: dict[str, Any] = _interpolate_all(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), env or {})
    for service in data["services"].values():
        service["environment"] = {k: str(v) for k, v in (service.get("environment") or {}).items()}
    return data


def service_address(compose: dict[str, Any], name: str) -> str:
    """``name:port`` as other services reach it (its framed port; PostgreSQL's own port)."""
    service = compose["services"][name]
    if str(service.get("image", "")).startswith("postgres:"):
        return f"{name}:{POSTGRES_PORT}"
    env = service["environment"]
    return f"{name}:{next(v for k, v in env.items() if k.endswith('_FRAMED_PORT'))}"


def published_port(compose: dict[str, Any], name: str, container_port: str) -> str | None:
    """The host port a service's ``ports`` publishes ``container_port`` on (None: not published)."""
    for mapping in compose["services"][name].get("ports", []):
        host, _, container = str(mapping).rpartition(":")
        if container.split("/")[0] == container_port:
            return host.rpartition(":")[2] or None  # "IP:HOST:CONTAINER" or "HOST:CONTAINER"
    return None
