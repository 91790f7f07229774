"""docker-compose.yml: its structure, every setting it passes, and the same topology run as processes.

No Docker engine runs here, so the compose file is checked the way compose would read it (YAML
with anchors and merge keys, ``${VAR:-default}`` interpolation), each service's environment is
loaded by the service's own config loader, and then the same services — same commands, same
environment, hosts and ports mapped to loopback — run as processes, with the client service's
FUSE mount on top and a client on "the host" that knows only mgmtd's published address and
reaches every other service by the addresses they advertise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

import fs3  # noqa: E402
from fs3.cluster.processes import pick_port  # noqa: E402
from fs3.common.config import load_config  # noqa: E402
from fs3.meta.server import MetaConfig  # noqa: E402
from fs3.mgmtd.service import MgmtdConfig  # noqa: E402
from fs3.rpc.tls import TlsConfig  # noqa: E402
from fs3.storage.server import StorageConfig  # noqa: E402
from tests.chaos.topology import (  # noqa: E402
    HA_SERVER_SERVICES,
    PROFILES,
    ROOT,
    SERVER_SERVICES,
    load_compose,
    published_port,
    service_address,
)

# What an operator exports before `docker compose up` (the file has no default token); the HAI
# Platform's services (profile "hai") also take theirs from the environment.
COMPOSE_ENV = {"FS3_TOKEN": "6f1c0d2e9a8b7c6d5e4f3a2b1c0d9e8f"}
# The `ha` profile's database password (required by the postgres service; hex, as the file says).
HA_ENV = {**COMPOSE_ENV, "FS3_PG_PASSWORD": "0a1b2c3d4e5f60718293a4b5c6d7e8f9"}
HA_FS3 = [name for name in HA_SERVER_SERVICES if name != "postgres"]
HA_MGMTD = [name for name in HA_FS3 if name.startswith("ha-mgmtd")]
HA_META = [name for name in HA_FS3 if name.startswith("ha-meta")]
HAI_ENV = {"HAI_ADMIN_TOKEN": "a3" * 32, "HAI_AGENT_TOKEN": "b4" * 32,
           "HAI_ADMIN_FS3_TOKEN": "fs3u.0123456789abcdef." + "c5" * 16}  # an fs3 user token
HAI_AGENTS = ["hai-agent-1", "hai-agent-2"]
ADVERTISING = ["meta", "storage1", "storage2", "storage3"]  # mgmtd is dialled at the address a client is given

ServiceConfig = MgmtdConfig | MetaConfig | StorageConfig
CONFIGS: dict[str, tuple[type[ServiceConfig], str]] = {
    "mgmtd": (MgmtdConfig, "FS3_MGMTD"), "meta": (MetaConfig, "FS3_META"), "storage": (StorageConfig, "FS3_STORAGE")}


def test_compose_file_structure() -> None:
    compose = load_compose(COMPOSE_ENV)
    services = compose["services"]
    assert set(services) == {"certs", "mgmtd", "meta", "storage1", "storage2", "storage3", "setup", "client",
                             "hai-server", *HAI_AGENTS, *HA_SERVER_SERVICES, "ha-setup", "ha-client"}
    # What a plain `docker compose up` starts: the services of no profile, as before the profiles.
    assert {name for name, s in services.items() if not s.get("profiles")} == {
        "certs", "mgmtd", "meta", "storage1", "storage2", "storage3", "setup", "client"}
    assert (ROOT / "Dockerfile").exists() and all(s.get("build") == "." for n, s in services.items()
                                                  if n != "postgres")
    for name in [*SERVER_SERVICES, "client"]:
        assert "test" in services[name]["healthcheck"], name
    for name in SERVER_SERVICES:
        volume = services[name]["volumes"][0].split(":")[0]
        assert volume in compose["volumes"], f"{name} keeps its data in a named volume"
    assert services["meta"]["depends_on"]["mgmtd"]["condition"] == "service_healthy"
    for n in (1, 2, 3):
        assert services[f"storage{n}"]["depends_on"]["mgmtd"]["condition"] == "service_healthy"
        assert services["setup"]["depends_on"][f"storage{n}"]["condition"] == "service_healthy"
    client = services["client"]
    assert client["depends_on"]["setup"]["condition"] == "service_completed_successfully"
    assert client["depends_on"]["meta"]["condition"] == "service_healthy"
    assert "/dev/fuse:/dev/fuse" in client["devices"] and "SYS_ADMIN" in client["cap_add"]
    assert client["command"][:1] == ["mount"] and "--foreground" in client["command"]
    tokens = {s["environment"].get(k) for s in services.values() for k in s["environment"]
              if k.startswith("FS3_") and k.endswith("TOKEN")}
    assert tokens == {COMPOSE_ENV["FS3_TOKEN"]}, "every service shares the operator's token"
    # Mutual TLS by default: certificates made first, mounted read-only wherever they are used.
    assert services["mgmtd"]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert "certs:/certs" in services["certs"]["volumes"] and "certs" in compose["volumes"]
    for name in [*SERVER_SERVICES, "setup", "client"]:
        assert "certs:/certs:ro" in services[name]["volumes"], name
    for name in ("setup", "client"):
        env = services[name]["environment"]
        assert (env["FS3_TLS_CA_FILE"], env["FS3_TLS_CERT_FILE"]) == ("/certs/ca.pem", "/certs/client.pem"), name


def test_compose_refuses_to_start_without_a_token() -> None:
    """No fixed fallback token: a cluster started without FS3_TOKEN would share a published secret."""
    assert "fs3-compose-token" not in (ROOT / "docker-compose.yml").read_text()
    with pytest.raises(ValueError, match="FS3_TOKEN"):
        load_compose({})


def test_every_process_publishes_its_metrics_port() -> None:
    services = load_compose(COMPOSE_ENV)["services"]
    published = {}
    for name in SERVER_SERVICES:
        env = services[name]["environment"]
        metrics_port = next(v for k, v in env.items() if k.endswith("_METRICS_PORT"))
        mapped = [p.split(":") for p in services[name]["ports"]]
        host = [h for h, c in mapped if c == metrics_port]
        assert host, f"{name} publishes its /metrics port"
        published[name] = host[0]
    assert len(set(published.values())) == len(published), "one host port per process"


def _port(env: dict[str, str], suffix: str) -> str:
    return next(v for k, v in env.items() if k.endswith(suffix))


def test_every_service_advertises_the_public_host_on_ports_published_one_to_one() -> None:
    """What a host client is routed to must be reachable from the host and from the compose network
    alike: one host for every service (the operator's FS3_PUBLIC_HOST, else the service's own name),
    ports no two services share, each published on the same port number."""
    default = load_compose(COMPOSE_ENV)["services"]
    public = load_compose({**COMPOSE_ENV, "FS3_PUBLIC_HOST": "fs3.example.net"})["services"]
    empty = load_compose({**COMPOSE_ENV, "FS3_PUBLIC_HOST": ""})["services"]  # compose's ":-": empty is unset
    for name in ADVERTISING:
        advertise = next(k for k in default[name]["environment"] if k.endswith("_ADVERTISE_HOST"))
        assert default[name]["environment"][advertise] == name
        assert empty[name]["environment"][advertise] == name
        assert public[name]["environment"][advertise] == "fs3.example.net"
    compose = load_compose(COMPOSE_ENV)
    seen: dict[str, str] = {}
    for name in SERVER_SERVICES:
        env = compose["services"][name]["environment"]
        for suffix in ("_FRAMED_PORT", "_GRPC_PORT", "_METRICS_PORT"):
            port = _port(env, suffix)
            assert port not in seen, f"{name} and {seen.get(port)} share port {port}"
            seen[port] = name
            assert published_port(compose, name, port) == port, f"{name} publishes {suffix[1:]} {port} as {port}"
    # The certificates name the public host too (hostname verification), and nothing when unset.
    command = public["certs"]["command"]
    assert command[command.index("--san") + 1] == "fs3.example.net"
    command = default["certs"]["command"]
    assert command[command.index("--san") + 1] == ""
    # FS3_PUBLIC_HOST=host.docker.internal resolves in every fs3 container, Linux included.
    for name, service in default.items():
        if service["image"] != default["mgmtd"]["image"]:
            continue  # postgres: the official image, dialled by no client
        assert "host.docker.internal:host-gateway" in service.get("extra_hosts", []), name


def test_published_port_reads_compose_port_mappings() -> None:
    compose = {"services": {"s": {"ports": ["9020:9020", "127.0.0.1:9130:9030", "9140:9040/tcp", 9050]}}}
    assert published_port(compose, "s", "9020") == "9020"
    assert published_port(compose, "s", "9030") == "9130"
    assert published_port(compose, "s", "9040") == "9140"
    assert published_port(compose, "s", "9050") is None  # a bare port is published on a random one
    assert published_port(compose, "s", "9060") is None


def test_interpolation_follows_compose() -> None:
    from tests.chaos.topology import _interpolate

    env = {"SET": "v", "EMPTY": ""}
    assert _interpolate("${SET:-d} ${EMPTY:-d} ${UNSET:-d} ${EMPTY-d} ${UNSET-d}", env) == "v d d  d"
    assert _interpolate("$SET ${SET} $$SET ${UNSET}", env) == "v v $SET "
    with pytest.raises(ValueError, match="EMPTY: needed"):
        _interpolate("${EMPTY:?needed}", env)
    assert _interpolate("${EMPTY?needed}", env) == ""
    with pytest.raises(ValueError, match="UNSET: needed"):
        _interpolate("${UNSET?needed}", env)


def test_no_secret_in_any_command_line() -> None:
    """Arguments are visible to every user of a host (ps); tokens travel in the environment."""
    services = load_compose({**COMPOSE_ENV, **HAI_ENV})["services"]
    tokens = {v for s in services.values() for k, v in s["environment"].items() if k.endswith("TOKEN")}
    assert "" not in tokens
    for name, service in services.items():
        command = service.get("command", [])
        words = [command] if isinstance(command, str) else list(command)
        words += service.get("entrypoint", []) if isinstance(service.get("entrypoint"), list) else []
        assert not any(t in w for t in tokens for w in words), f"{name}'s command line holds a token"
        assert not any("--token" in w and "--token-file" not in w for w in words), name


def test_the_hai_services(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The HAI Platform's server and agents: the same image, in the "hai" profile, started after
    what they need; every token from the operator's environment (none in the file, the server
    refusing to start without them); commands ``hai`` itself parses; and the server's environment,
    as the server reads it, lets in exactly the tokens the agents and the operator hold."""
    from hai.__main__ import build_parser
    from hai.server import USERS_FILE, Users, hash_token, tokens_from_environment

    text = (ROOT / "docker-compose.yml").read_text()
    assert not any(token in text for token in [*HAI_ENV.values(), *COMPOSE_ENV.values()])
    compose = load_compose({**COMPOSE_ENV, **HAI_ENV})
    services = compose["services"]
    server = services["hai-server"]
    assert server["image"] == services["mgmtd"]["image"] and server["build"] == "."
    assert server["entrypoint"] == ["hai"] and server["profiles"] == ["hai"]
    assert "hai-data:/hai" in server["volumes"] and "hai-data" in compose["volumes"]
    assert "test" in server["healthcheck"]
    parsed = build_parser().parse_args(server["command"])
    assert parsed.command == "server" and parsed.require_env_tokens and str(parsed.dir) == "/hai"
    assert parsed.host == "0.0.0.0" and published_port(compose, "hai-server", str(parsed.port)) == str(parsed.port)
    assert parsed.default_quota_nodes == len(HAI_AGENTS)
    # The server never holds the cluster token: the admin's ranks get an fs3 user token.
    assert server["environment"] == HAI_ENV
    # Unset, the tokens are empty (no default), and the server says so instead of starting.
    unset = load_compose(COMPOSE_ENV)["services"]["hai-server"]["environment"]
    assert unset["HAI_ADMIN_TOKEN"] == unset["HAI_AGENT_TOKEN"] == unset["HAI_ADMIN_FS3_TOKEN"] == ""
    refused = build_parser().parse_args([arg.replace("/hai", str(tmp_path / "unset")) for arg in server["command"]])
    saved = {name: os.environ.pop(name, None) for name in unset}
    try:
        assert refused.run(refused) == 2
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    assert "HAI_ADMIN_TOKEN, HAI_AGENT_TOKEN, HAI_ADMIN_FS3_TOKEN" in capsys.readouterr().err
    tokens_from_environment(tmp_path, server["environment"])
    users = Users.load(tmp_path / USERS_FILE)
    admin = users.user_for(HAI_ENV["HAI_ADMIN_TOKEN"])
    assert admin is not None and admin.admin and admin.fs3_token == HAI_ENV["HAI_ADMIN_FS3_TOKEN"]
    assert users.agent_token_sha256 == hash_token(HAI_ENV["HAI_AGENT_TOKEN"])
    assert HAI_ENV["HAI_ADMIN_TOKEN"] not in (tmp_path / USERS_FILE).read_text()
    nodes = set()
    for name in HAI_AGENTS:
        agent = services[name]
        assert agent["entrypoint"] == ["hai"] and agent["profiles"] == ["hai"] and agent["image"] == server["image"]
        assert agent["depends_on"] == {"hai-server": {"condition": "service_healthy"},
                                       "meta": {"condition": "service_healthy"},
                                       "setup": {"condition": "service_completed_successfully"}}
        args = build_parser().parse_args(agent["command"])
        assert args.command == "agent" and args.server == f"http://hai-server:{parsed.port}"
        assert args.address == name, "MASTER_ADDR: the name the other agents' ranks resolve"
        assert args.fs3 == service_address(compose, "mgmtd"), "rank logs go to the compose fs3"
        assert args.token_file is None, "the agent token comes from HAI_AGENT_TOKEN"
        nodes.add(args.node)
        env = agent["environment"]
        assert env["HAI_AGENT_TOKEN"] == HAI_ENV["HAI_AGENT_TOKEN"] and env["FS3_TOKEN"] == COMPOSE_ENV["FS3_TOKEN"]
        assert env["FS3_TLS_CERT_FILE"] == services["client"]["environment"]["FS3_TLS_CERT_FILE"]
        assert "certs:/certs:ro" in agent["volumes"]
        assert "HAI_ADMIN_TOKEN" not in env and "HAI_ADMIN_FS3_TOKEN" not in env, "an agent never holds the admin's"
    assert len(nodes) == len(HAI_AGENTS)


@pytest.mark.parametrize("fs3_token", ["", "6f1c0d2e9a8b7c6d5e4f3a2b1c0d9e8f", "fs3u.nothex.secretsecretsecret"])
def test_the_admin_s_ranks_never_get_a_token_that_is_not_an_fs3_user_token(tmp_path: Path, fs3_token: str) -> None:
    """The cluster token (FS3_TOKEN) would make the admin's ranks an fs3 service, past every
    permission: only a user token is taken, and FS3_TOKEN is never a fallback."""
    from hai.server import USERS_FILE, tokens_from_environment

    env = {**HAI_ENV, "HAI_ADMIN_FS3_TOKEN": fs3_token, "FS3_TOKEN": COMPOSE_ENV["FS3_TOKEN"]}
    with pytest.raises(ValueError, match=r"HAI_ADMIN_FS3_TOKEN is .*fs3 user token"):
        tokens_from_environment(tmp_path, env)
    assert not (tmp_path / USERS_FILE).exists(), "nothing written"


def test_the_environment_s_tokens_are_read_only_with_require_env_tokens(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An exported HAI_ADMIN_TOKEN in an operator's shell must not replace the admin of a server
    started without --require-env-tokens."""
    import hai.server
    from hai.__main__ import build_parser
    from hai.server import USERS_FILE, Users, hash_token

    for name, value in HAI_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(hai.server, "HaiServer", _Stop)  # up to where the server would be made
    args = build_parser().parse_args(["server", "--dir", str(tmp_path), "--port", "0"])
    with pytest.raises(_Stopped):
        args.run(args)
    users = Users.load(tmp_path / USERS_FILE)
    assert users.user_for(HAI_ENV["HAI_ADMIN_TOKEN"]) is None
    assert users.agent_token_sha256 != hash_token(HAI_ENV["HAI_AGENT_TOKEN"])


class _Stopped(Exception):
    pass


class _Stop:
    def __init__(self, *_args: object) -> None:
        raise _Stopped


@pytest.mark.parametrize("name", SERVER_SERVICES)
def test_every_setting_is_one_the_service_reads(name: str) -> None:
    service = load_compose(COMPOSE_ENV)["services"][name]
    kind = service["command"][0]
    cls, prefix = CONFIGS[kind]
    fields = {f.name.upper() for f in dataclasses.fields(cls)}
    unknown = [k for k in service["environment"] if k.startswith(prefix + "_") and k[len(prefix) + 1:] not in fields]
    assert unknown == [], f"{name}: settings no service reads: {unknown}"
    config: ServiceConfig = load_config(cls, None, env_prefix=prefix, environ=service["environment"])  # validates
    assert config.token == COMPOSE_ENV["FS3_TOKEN"] and config.listen_host == "0.0.0.0"
    assert (config.tls.ca_file, config.tls.cert_file, config.tls.key_file) == (
        "/certs/ca.pem", f"/certs/{name}.pem", f"/certs/{name}.key"), "each service has its own certificate"
    if isinstance(config, StorageConfig):
        assert len(config.targets) == 2 and all(t.path.startswith("/data/") for t in config.targets)


def test_the_certs_service_makes_every_file_the_services_name(tmp_path: Path) -> None:
    """The certs service's command, run as its container runs it, leaves each service and client the
    files its TLS settings name, each node's certificate naming the host the others dial it by; run
    again once FS3_PUBLIC_HOST is set, it re-issues them (same keys) to name the public host too."""
    from cryptography import x509

    from fs3.cli.main import main as fs3_main
    from fs3.rpc.tls import Tls

    def certs_run(env: dict[str, str]) -> dict[str, ServiceConfig]:
        services = load_compose(env)["services"]
        command = [arg.replace("/certs", str(tmp_path)) for arg in services["certs"]["command"]]
        assert fs3_main(command) == 0
        configs: dict[str, ServiceConfig] = {}
        for name in SERVER_SERVICES:
            cls, prefix = CONFIGS[services[name]["command"][0]]
            env = {k: v.replace("/certs", str(tmp_path)) for k, v in services[name]["environment"].items()}
            configs[name] = load_config(cls, None, env_prefix=prefix, environ=env)
            assert Tls.load(configs[name].tls, server=True) is not None, name  # readable, key matches, private
        return configs

    def names(config: ServiceConfig) -> list[str]:
        cert = x509.load_pem_x509_certificate(Path(config.tls.cert_file).read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return [*sans.get_values_for_type(x509.DNSName), *map(str, sans.get_values_for_type(x509.IPAddress))]

    configs = certs_run(COMPOSE_ENV)
    keys = {name: Path(c.tls.key_file).read_bytes() for name, c in configs.items()}
    for name, config in configs.items():
        assert names(config) == [name], name
    configs = certs_run({**COMPOSE_ENV, "FS3_PUBLIC_HOST": "192.0.2.10"})
    for name, config in configs.items():
        assert names(config) == [name, "192.0.2.10"], name
        assert Path(config.tls.key_file).read_bytes() == keys[name], f"{name} keeps its key"
    services = load_compose(COMPOSE_ENV)["services"]
    env = services["client"]["environment"]
    client = TlsConfig(*(env[f"FS3_TLS_{k}"].replace("/certs", str(tmp_path)) for k in ("CA_FILE", "CERT_FILE",
                                                                                        "KEY_FILE")))
    assert Tls.load(client) is not None


def _rpc_counts(metrics_address: str) -> dict[str, float]:
    """Requests a process served, by method (fs3_rpc_requests_total), from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as rsp:
        text = rsp.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "fs3_rpc_requests_total":
                method = sample.labels["method"]
                counts[method] = counts.get(method, 0.0) + sample.value
    return counts


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="the client service mounts with FUSE")
def test_the_compose_topology_runs_as_processes(tmp_path: Path) -> None:
    pytest.importorskip("pyfuse3", reason="the fuse extra is not installed")
    # The operator publishes the cluster on its host's address; here host and compose network are
    # both loopback, so that address is 127.0.0.1.
    public_host = "127.0.0.1"
    compose = load_compose({**COMPOSE_ENV, "FS3_PUBLIC_HOST": public_host})
    services = compose["services"]
    # Every port the file names (each service's own, published on the same number) becomes one free
    # loopback port wherever it appears; "name:port" addresses follow.
    ports: dict[str, str] = {}
    for name in SERVER_SERVICES:
        for key, value in services[name]["environment"].items():
            if key.endswith(("_FRAMED_PORT", "_GRPC_PORT", "_METRICS_PORT")):
                ports[value] = str(pick_port())
    addresses = {f"{name}:{framed}": f"127.0.0.1:{ports[framed]}" for name in SERVER_SERVICES
                 for framed in [_port(services[name]["environment"], "_FRAMED_PORT")]}

    def localize(name: str, value: str) -> str:
        for address, local in addresses.items():
            value = value.replace(address, local)
        value = value.replace("/data", str(tmp_path / name))
        return value.replace("/certs", str(tmp_path / "certs"))

    def public_address(name: str, suffix: str) -> str:
        """Where the host reaches a service's port: the public host and the port compose publishes."""
        published = published_port(compose, name, _port(services[name]["environment"], suffix))
        assert published is not None, f"{name} publishes its {suffix[1:]}"
        return f"{public_host}:{ports[published]}"

    procs: list[subprocess.Popen[bytes]] = []
    bin_dir = Path(sys.executable).parent
    base_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        # The certs service as it is: each node's certificate names the public host through --san.
        certs = [localize("certs", arg) for arg in services["certs"]["command"]]
        done = subprocess.run([sys.executable, "-P", "-m", "fs3.cli.main", *certs], env=base_env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        for name in SERVER_SERVICES:
            env = {k: localize(name, v) for k, v in services[name]["environment"].items()}
            for key in list(env):
                if key.endswith(("_FRAMED_PORT", "_GRPC_PORT", "_METRICS_PORT")):
                    env[key] = ports[env[key]]
                elif key.endswith("_LISTEN_HOST"):
                    env[key] = "127.0.0.1"
                elif key.endswith("_ADVERTISE_HOST"):
                    assert env[key] == public_host, f"{name} advertises the public host"
            ready = tmp_path / f"{name}.ready"
            log = (tmp_path / f"{name}.log").open("wb")
            procs.append(subprocess.Popen([sys.executable, "-P", "-m", "fs3.cli.main", *services[name]["command"],
                                           "--ready-file", str(ready)], env={**base_env, **env}, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert procs[-1].poll() is None, (tmp_path / f"{name}.log").read_text()
                assert time.monotonic() < deadline, f"{name} not ready"
                time.sleep(0.05)
        setup = services["setup"]
        command = localize("setup", setup["command"][0])
        client_env = {k: localize("client", v) for k, v in setup["environment"].items()}
        done = subprocess.run(["sh", "-c", command], env={**base_env, **client_env}, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        client = services["client"]
        mount_cmd = [localize("client", c) for c in client["command"]]
        mount_cmd[mount_cmd.index("/mnt/fs3")] = str(mnt)
        ready = tmp_path / "client.ready"
        procs.append(subprocess.Popen([sys.executable, "-P", "-m", "fs3.cli.main", *mount_cmd, "--ready-file",
                                       str(ready)], env={**base_env, **client_env},
                                      stdout=(tmp_path / "client.log").open("wb"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
        deadline = time.monotonic() + 60
        while not (ready.exists() and os.path.ismount(mnt)):
            assert procs[-1].poll() is None, (tmp_path / "client.log").read_text()
            assert time.monotonic() < deadline, "client not mounted"
            time.sleep(0.05)
        (mnt / "hello.txt").write_text("from the compose topology\n")
        assert (mnt / "hello.txt").read_text() == "from the compose topology\n"
        chains = subprocess.run([sys.executable, "-m", "fs3.cli.main", "admin", "--mgmtd",
                                 addresses["mgmtd:9000"], "--json", "chains"], env={**base_env, **client_env},
                                capture_output=True, text=True)
        assert chains.returncode == 0 and chains.stdout.count("target_ids") == 2, chains.stdout

        # A client on the host knows mgmtd's published address; mgmtd routes it to what each
        # service advertises, which must be the public host and the port published for it.
        mgmtd = public_address("mgmtd", "_FRAMED_PORT")
        listed = subprocess.run([sys.executable, "-m", "fs3.cli.main", "admin", "--mgmtd", mgmtd, "--json",
                                 "nodes"], env={**base_env, **client_env}, capture_output=True, text=True)
        assert listed.returncode == 0, listed.stdout + listed.stderr
        node_ids = {_port(services[name]["environment"], "_NODE_ID"): name for name in ADVERTISING}
        nodes = {node_ids[str(n["node_id"])]: n for n in json.loads(listed.stdout) if n["node_type"] != "mgmtd"}
        assert set(nodes) == set(ADVERTISING)
        for name, node in nodes.items():
            assert (node["framed_address"], node["grpc_address"], node["metrics_address"]) == (
                public_address(name, "_FRAMED_PORT"), public_address(name, "_GRPC_PORT"),
                public_address(name, "_METRICS_PORT")), name

        # Create, write, read back and remove a file from the host, with only those addresses:
        # writes go to each chain's head, which forwards them to the other replicas by their
        # advertised addresses; reads rotate over the replicas.
        storage = [name for name in ADVERTISING if name.startswith("storage")]
        before = {name: _rpc_counts(nodes[name]["metrics_address"]) for name in storage}
        certs_dir = tmp_path / "certs"
        tls = TlsConfig(ca_file=str(certs_dir / "ca.pem"), cert_file=str(certs_dir / "client.pem"),
                        key_file=str(certs_dir / "client.key"))
        data = os.urandom(3 << 20)
        with fs3.connect(mgmtd, token=COMPOSE_ENV["FS3_TOKEN"], tls=tls) as host_client:
            host_client.makedirs("/from-the-host", exist_ok=True)
            host_client.write_bytes("/from-the-host/data.bin", data)
            for _ in range(2 * len(storage)):
                assert host_client.read_bytes("/from-the-host/data.bin") == data
            host_client.remove("/from-the-host/data.bin")
            assert not host_client.exists("/from-the-host/data.bin")
        for name in storage:
            after = _rpc_counts(nodes[name]["metrics_address"])
            served = {m for m, n in after.items() if n > before[name].get(m, 0.0)}
            # The client's reads; its writes as the chain's head (Update) or from the head (Forward).
            assert "Read" in served and {"Update", "Forward"} & served, f"{name} served only {sorted(served)}"
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        if os.path.ismount(mnt):
            subprocess.run([shutil.which("fusermount3") or "fusermount3", "-uz", str(mnt)], check=False)


# -- the `ha` profile -----------------------------------------------------------------------------


def test_the_ha_profile_s_structure() -> None:
    """A second cluster in the `ha` profile: PostgreSQL (the official image, its data in a volume,
    healthy only once it serves TCP), three mgmtd on it, three meta on it, three storage nodes,
    setup and a client, each started after what it needs; none of it in the default profile."""
    compose = load_compose(HA_ENV)
    services = compose["services"]
    profile = PROFILES["ha"]
    ha = [*profile.servers, profile.setup, profile.client]
    for name in ha:
        assert services[name]["profiles"] == ["ha"], name
    postgres = services["postgres"]
    assert postgres["image"] == "postgres:16" and "build" not in postgres
    volume = postgres["volumes"][0]
    assert volume.split(":") == ["postgres-data", "/var/lib/postgresql/data"] and "postgres-data" in compose["volumes"]
    health = postgres["healthcheck"]["test"]
    assert health[:2] == ["CMD", "pg_isready"] and health[health.index("-h") + 1] == "127.0.0.1"
    assert health[health.index("-d") + 1] == "fs3_mgmtd", "healthy once the init script made the second database"
    for name in HA_MGMTD:
        assert services[name]["depends_on"] == {"certs": {"condition": "service_completed_successfully"},
                                                "postgres": {"condition": "service_healthy"}}, name
    for name in [*HA_META, *[n for n in HA_FS3 if "storage" in n]]:
        assert services[name]["depends_on"] == {m: {"condition": "service_healthy"} for m in HA_MGMTD}, name
        assert "test" in services[name]["healthcheck"], name
    for n in (1, 2, 3):
        assert services["ha-setup"]["depends_on"][f"ha-storage{n}"]["condition"] == "service_healthy"
    client = services["ha-client"]
    assert client["depends_on"]["ha-setup"]["condition"] == "service_completed_successfully"
    assert all(client["depends_on"][m]["condition"] == "service_healthy" for m in HA_META)
    assert client["command"][0] == "mount" and "/dev/fuse:/dev/fuse" in client["devices"]
    for name in HA_FS3:
        assert "certs:/certs:ro" in services[name]["volumes"], name
        assert services[name]["image"] == services["mgmtd"]["image"], name
    for name in [n for n in HA_FS3 if "storage" in n]:
        assert services[name]["volumes"][0].split(":")[0] in compose["volumes"], f"{name} keeps its chunks"


def test_the_ha_profile_keeps_mgmtd_and_meta_in_separate_databases() -> None:
    """Both engines name their tables fs3_kv and fs3_info: mgmtd's state and the namespace must
    live in two databases of the one server. POSTGRES_DB is meta's; the init script, run by the
    image when it initialises the volume, makes mgmtd's."""
    services = load_compose(HA_ENV)["services"]
    env = services["postgres"]["environment"]
    user, password = env["POSTGRES_USER"], env["POSTGRES_PASSWORD"]
    assert password == HA_ENV["FS3_PG_PASSWORD"]
    databases: dict[str, set[str]] = {}
    for name in HA_FS3[:6]:
        kind = services[name]["command"][0]
        url = services[name]["environment"][f"FS3_{kind.upper()}_PG_URL"]
        assert services[name]["environment"][f"FS3_{kind.upper()}_KV_ENGINE"] == "postgres", name
        assert url.startswith(f"postgresql://{user}:{password}@{service_address(load_compose(HA_ENV), 'postgres')}/")
        databases.setdefault(kind, set()).add(url.rsplit("/", 1)[1])
    assert databases == {"mgmtd": {"fs3_mgmtd"}, "meta": {env["POSTGRES_DB"]}}
    assert env["POSTGRES_DB"] != "fs3_mgmtd"
    init = [v for v in services["postgres"]["volumes"] if "/docker-entrypoint-initdb.d/" in v]
    assert len(init) == 1 and init[0].endswith(":ro")
    sql = (ROOT / init[0].split(":")[0]).read_text()
    assert "CREATE DATABASE fs3_mgmtd;" in sql


def test_the_ha_profile_needs_the_database_password_and_writes_it_nowhere() -> None:
    """No default password: unset, the URLs carry none and the image refuses to initialise (compose
    interpolates every profile, so `:?` would stop the default profile too). The password is in no
    file and on no command line."""
    text = (ROOT / "docker-compose.yml").read_text()
    assert HA_ENV["FS3_PG_PASSWORD"] not in text and "POSTGRES_HOST_AUTH_METHOD" not in text
    unset = load_compose(COMPOSE_ENV)["services"]
    assert unset["postgres"]["environment"]["POSTGRES_PASSWORD"] == ""
    assert unset["ha-meta1"]["environment"]["FS3_META_PG_URL"].startswith("postgresql://fs3:@")
    for name, service in load_compose(HA_ENV)["services"].items():
        command = service.get("command", [])
        words = [command] if isinstance(command, str) else list(command)
        assert not any(HA_ENV["FS3_PG_PASSWORD"] in w for w in words), name


@pytest.mark.parametrize("name", HA_FS3)
def test_every_ha_setting_is_one_the_service_reads(name: str) -> None:
    """Each ha server's environment, loaded and validated by its own config loader: mgmtd on
    PostgreSQL with a unique instance name that redirects to its own framed port, meta on
    PostgreSQL with a unique node id, and storage, meta (and setup, the client) given all three
    mgmtd."""
    compose = load_compose(HA_ENV)
    services = compose["services"]
    kind = services[name]["command"][0]
    cls, prefix = CONFIGS[kind]
    env = services[name]["environment"]
    unknown = [k for k in env if k.startswith(prefix + "_") and k[len(prefix) + 1:] not in
               {f.name.upper() for f in dataclasses.fields(cls)}]
    assert unknown == [], f"{name}: settings no service reads: {unknown}"
    config: ServiceConfig = load_config(cls, None, env_prefix=prefix, environ=env)  # validates
    assert config.token == HA_ENV["FS3_TOKEN"] and config.listen_host == "0.0.0.0"
    assert (config.tls.cert_file, config.tls.key_file) == (f"/certs/{name}.pem", f"/certs/{name}.key")
    mgmtd = {service_address(compose, m) for m in HA_MGMTD}
    if isinstance(config, MgmtdConfig):
        assert config.kv_engine == "postgres" and config.instance_name == name
        assert config.advertise_address == f"{name}:{config.framed_port}"
        assert config.heartbeat_timeout_ms >= 2 * (config.lease_ms + config.lease_renew_interval_ms)
    elif isinstance(config, MetaConfig):
        assert config.kv_engine == "postgres" and set(config.mgmtd_address.split(",")) == mgmtd
        assert len({services[m]["environment"]["FS3_META_NODE_ID"] for m in HA_META}) == len(HA_META)
    else:
        assert set(config.mgmtd_address.split(",")) == mgmtd
        assert len(config.targets) == 2 and all(t.path.startswith("/data/") for t in config.targets)
    # The client and setup dial every mgmtd too (a client follows the primary).
    assert set(services["ha-client"]["command"][1].split(",")) == mgmtd
    setup = services["ha-setup"]["command"][0].split()
    assert [set(setup[i + 1].split(",")) for i, word in enumerate(setup) if word == "--mgmtd"] == [mgmtd, mgmtd]


def test_the_ha_profile_s_ports_and_certificates() -> None:
    """Every port of both clusters its own, published 1:1 (both can run side by side); the
    services advertise FS3_PUBLIC_HOST or their own names; the certs service makes a certificate
    naming each ha service."""
    compose = load_compose(HA_ENV)
    seen: dict[str, str] = {}
    for name in [*SERVER_SERVICES, *HA_FS3]:
        env = compose["services"][name]["environment"]
        for suffix in ("_FRAMED_PORT", "_GRPC_PORT", "_METRICS_PORT"):
            port = _port(env, suffix)
            assert port not in seen, f"{name} and {seen.get(port)} share port {port}"
            seen[port] = name
            assert published_port(compose, name, port) == port, f"{name} publishes {suffix[1:]} {port} as {port}"
    assert published_port(compose, "postgres", "5432") is None, "the database is for the cluster's network only"
    public = load_compose({**HA_ENV, "FS3_PUBLIC_HOST": "fs3.example.net"})["services"]
    for name in HA_FS3:
        env = compose["services"][name]["environment"]
        key = next((k for k in env if k.endswith("_ADVERTISE_HOST")), None)
        if key is None:  # mgmtd: the address its redirects name
            key = "FS3_MGMTD_ADVERTISE_ADDRESS"
            assert public[name]["environment"][key] == f"fs3.example.net:{env['FS3_MGMTD_FRAMED_PORT']}"
        else:
            assert env[key] == name and public[name]["environment"][key] == "fs3.example.net"
    command = compose["services"]["certs"]["command"]
    hosts = command[command.index("--hosts") + 1].split(",")
    assert set(HA_FS3) <= set(hosts) and set(SERVER_SERVICES) <= set(hosts)


def test_the_ha_profile_s_certificates_are_made(tmp_path: Path) -> None:
    from fs3.cli.main import main as fs3_main
    from fs3.rpc.tls import Tls

    services = load_compose(HA_ENV)["services"]
    assert fs3_main([arg.replace("/certs", str(tmp_path)) for arg in services["certs"]["command"]]) == 0
    for name in HA_FS3:
        cls, prefix = CONFIGS[services[name]["command"][0]]
        env = {k: v.replace("/certs", str(tmp_path)) for k, v in services[name]["environment"].items()}
        assert Tls.load(load_config(cls, None, env_prefix=prefix, environ=env).tls, server=True) is not None, name
