"""Secrets at rest, out of process arguments and logs, and cluster-token rotation without downtime.

Unit checks of the secret files (created 0600, refused when other users may read them), of the
token reload and of a rotation on both transports; then a real ``fs3 local`` cluster: no token in
any process's arguments or logs, nothing of it readable by a second local user (``nobody``), and a
rotation that no process restarts for.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import fs3
from fs3 import mgmtd_pb2 as mpb
from fs3.cli.cluster import TOKEN_ARGV_WARNING
from fs3.cli.local import LocalCluster
from fs3.cli.main import main
from fs3.common.config import load_config
from fs3.common.errors import InvalidArgument, Unauthenticated
from fs3.common.secret_files import (
    TokenSource,
    check_config_file,
    check_secret_file,
    make_private_dir,
    read_token_file,
    write_secret_file,
    write_token_file,
)
from fs3.kv.store import MemKVStore
from fs3.mgmtd.service import MgmtdConfig, MgmtdServicer
from fs3.rpc.auth import SERVICE, TRUSTED, Authenticator
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.framed import FramedChannel, FramedServer
from fs3.rpc.grpc_transport import GrpcChannel, GrpcServer
from fs3.rpc.methods import service_spec
from fs3.rpc.server import TokenReloader
from fs3.storage.server import StorageConfig

NOBODY = 65534
MGMTD = service_spec("Mgmtd")
ROUTING = MGMTD.method("GetRoutingInfo")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- secret files ---------------------------------------------------------------------------------


def test_secret_files_are_created_private_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("old\n")
    path.chmod(0o644)
    old_umask = os.umask(0)
    try:
        write_token_file(path, ["new", "old"])
    finally:
        os.umask(old_umask)
    assert _mode(path) == 0o600 and path.stat().st_uid == os.geteuid()
    assert read_token_file(path) == ["new", "old"]
    assert [p.name for p in tmp_path.iterdir()] == ["token"]  # no temporary file left behind


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602])
def test_a_secret_file_others_may_access_is_refused_naming_the_fix(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "token"
    write_token_file(path, ["s3cret-token"])
    path.chmod(mode)
    with pytest.raises(InvalidArgument) as caught:
        read_token_file(path)
    message = str(caught.value)
    assert str(path) in message and f"chmod 600 {path}" in message and f"{mode:04o}" in message
    assert "s3cret-token" not in message
    path.chmod(0o400)
    assert read_token_file(path) == ["s3cret-token"]


def test_a_secret_file_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    path = tmp_path / "token"
    write_token_file(path, ["t"])
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(InvalidArgument, match=f"owned by uid {NOBODY}.*chown {os.geteuid()} {path}"):
        check_secret_file(path)


def test_token_files_hold_well_formed_tokens(tmp_path: Path) -> None:
    path = tmp_path / "token"
    write_secret_file(path, "\n  first \n\nsecond\n")
    assert read_token_file(path) == ["first", "second"]
    write_secret_file(path, "\n \n")
    with pytest.raises(InvalidArgument, match="holds no token"):
        read_token_file(path)
    write_secret_file(path, "good\nhas a space-in-it\n")
    with pytest.raises(InvalidArgument, match="line 2") as caught:
        read_token_file(path)
    assert "space-in-it" not in str(caught.value)  # a token with a typo is still a secret
    with pytest.raises(InvalidArgument):
        write_token_file(path, ["two words"])
    assert path.read_text() == "good\nhas a space-in-it\n"  # a refused write changes nothing
    with pytest.raises(InvalidArgument, match="does not exist"):
        read_token_file(tmp_path / "missing")


def test_a_config_file_is_checked_when_it_holds_a_token(tmp_path: Path) -> None:
    inline = tmp_path / "inline.toml"
    inline.write_text('node_id = 1\ntoken = "s3cret"\n')
    inline.chmod(0o644)
    with pytest.raises(InvalidArgument, match=f"chmod 600 {inline}"):
        check_config_file(inline)
    by_file = tmp_path / "by-file.toml"
    by_file.write_text(f'node_id = 1\ntoken_file = "{tmp_path / "token"}"\n')
    by_file.chmod(0o644)
    check_config_file(by_file)  # names where the token is: not a secret itself
    trusted = tmp_path / "trusted.toml"
    trusted.write_text('trusted_token = "x"\n')
    trusted.chmod(0o640)
    with pytest.raises(InvalidArgument):
        check_config_file(trusted)


def test_token_and_token_file_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="not both"):
        TokenSource("t", str(tmp_path / "token"))
    with pytest.raises(InvalidArgument, match="not both"):
        load_config(StorageConfig, None, env_prefix="FS3_STORAGE", environ={
            "FS3_STORAGE_TARGETS": '[{target_id = 101, path = "/x"}]', "FS3_STORAGE_TOKEN": "t",
            "FS3_STORAGE_TOKEN_FILE": "/x/token"})
    assert "s3cret" not in repr(MgmtdConfig(token="s3cret")) + repr(TokenSource("s3cret"))


def test_private_dirs_are_made_0700_and_tightened(tmp_path: Path) -> None:
    fresh = tmp_path / "a" / "b"
    make_private_dir(fresh)
    assert _mode(fresh) == 0o700
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    old.chmod(0o755)
    make_private_dir(old)
    assert _mode(old) == 0o700


def test_a_data_or_certificate_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    """A directory someone else owns is theirs whatever its mode (they may chmod it back, and
    rename, replace or plant entries in it): a cluster directory a local user made in advance
    (``/tmp/fs3``) would hand root their configs, and a certificate directory their CA, which
    ``certs init`` keeps and signs every node with."""
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    from fs3.cluster.certs import init_certs

    for name in ("data", "certs"):
        planted = tmp_path / name
        planted.mkdir(mode=0o755)
        os.chown(planted, NOBODY, NOBODY)
        with pytest.raises(InvalidArgument, match=f"owned by uid {NOBODY}"):
            if name == "data":
                make_private_dir(planted)
            else:
                init_certs(planted, {"meta": ["127.0.0.1"]})
        assert _mode(planted) == 0o755 and not list(planted.iterdir())  # untouched, nothing written
    with pytest.raises(InvalidArgument, match=f"owned by uid {NOBODY}"):
        LocalCluster(tmp_path / "data")


def _fs3(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "fs3.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_a_service_refuses_to_start_with_a_secret_others_can_read(tmp_path: Path) -> None:
    config = tmp_path / "mgmtd.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\nkv_engine = "mem"\ntoken = "s3cret"\n')
    config.chmod(0o644)
    done = _fs3("mgmtd", "--config", str(config))
    assert done.returncode == 1 and f"chmod 600 {config}" in done.stderr, done.stderr
    assert "s3cret" not in done.stdout + done.stderr
    token = tmp_path / "token"
    write_token_file(token, ["s3cret"])
    token.chmod(0o640)
    config.write_text(f'kv_engine = "mem"\nmetrics_port = -1\nframed_port = 0\ngrpc_port = 0\n'
                      f'token_file = "{token}"\n')
    done = _fs3("mgmtd", "--config", str(config))
    assert done.returncode == 1 and f"chmod 600 {token}" in done.stderr, done.stderr
    assert "s3cret" not in done.stdout + done.stderr


def test_a_token_on_the_command_line_is_warned_about() -> None:
    done = _fs3("admin", "--mgmtd", "127.0.0.1:1", "--token", "t", "--timeout-ms", "200", "nodes")
    assert done.returncode == 1 and TOKEN_ARGV_WARNING in done.stderr
    quiet = _fs3("admin", "--mgmtd", "127.0.0.1:1", "--timeout-ms", "200", "nodes")
    assert quiet.returncode == 1 and TOKEN_ARGV_WARNING not in quiet.stderr


# -- reloading and rotating on the transports -----------------------------------------------------


def test_a_reload_keeps_the_tokens_when_the_file_is_bad(tmp_path: Path) -> None:
    path = tmp_path / "token"
    write_token_file(path, ["old"])
    tokens = TokenReloader(TokenSource(token_file=str(path)))
    channels = tokens.channel_factory("framed")
    assert tokens.auth.authenticate("old") is not None and channels.token == "old"
    write_token_file(path, ["new", "old"])
    path.chmod(0o644)  # a careless edit: refused, and the service keeps what it had
    assert not tokens.reload()
    assert tokens.auth.authenticate("new") is None and channels.token == "old"
    path.chmod(0o600)
    assert tokens.reload()
    assert tokens.auth.authenticate("new") is not None and tokens.auth.authenticate("old") is not None
    assert channels.token == "new"
    assert not TokenReloader(TokenSource(token="inline")).reload()  # nothing to read again


def test_trusted_client_tokens_come_from_their_own_file_and_reload_too(tmp_path: Path) -> None:
    """A mount daemon's token: client methods only, acting for its callers; revoked by editing the
    file and a SIGHUP, like the cluster tokens (and refused when the file is not private)."""
    cluster, trusted = tmp_path / "token", tmp_path / "trusted"
    write_token_file(cluster, ["cluster-token"])
    write_token_file(trusted, ["mount-a", "mount-b"])
    tokens = TokenReloader(TokenSource(token_file=str(cluster), trusted_token_file=str(trusted)))
    assert tokens.auth.authenticate("cluster-token") == SERVICE
    assert tokens.auth.authenticate("mount-a") == TRUSTED and tokens.auth.authenticate("mount-b") == TRUSTED
    mount = tokens.auth.authenticate("mount-a")
    assert mount is not None and not mount.may_call("Mgmtd", "Heartbeat") and mount.may_call("Meta", "Open")
    write_token_file(trusted, ["mount-b"])
    assert tokens.reload()
    assert tokens.auth.authenticate("mount-a") is None and tokens.auth.authenticate("mount-b") == TRUSTED
    assert tokens.auth.authenticate("cluster-token") == SERVICE
    trusted.chmod(0o644)
    assert not tokens.reload() and tokens.auth.authenticate("mount-b") == TRUSTED
    with pytest.raises(InvalidArgument, match="chmod 600"):
        TokenReloader(TokenSource(token_file=str(cluster), trusted_token_file=str(trusted)))


def test_a_rotation_on_the_framed_transport_fails_no_call(tmp_path: Path) -> None:
    """An open connection keeps serving during a rotation; a channel switched to the new token
    finishes its calls in flight on the old connection; once the old token is dropped, connections
    opened with it are refused at their next call."""
    async def body() -> None:
        servicer = MgmtdServicer(MemKVStore(), MgmtdConfig(kv_engine="mem"))
        servicer.start()
        held = asyncio.Event()
        release = asyncio.Event()
        original = getattr(servicer, ROUTING.handler_name)

        async def slow_once(request: mpb.GetRoutingInfoReq, payload: memoryview) -> object:
            if not held.is_set():
                held.set()
                await release.wait()
            return await original(request, payload)

        setattr(servicer, ROUTING.handler_name, slow_once)
        auth = Authenticator(["old"])
        dispatcher = Dispatcher(auth=auth)
        dispatcher.add_service(MGMTD, servicer)
        server = FramedServer(dispatcher)
        address = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
        switching, bystander = FramedChannel(address, "old"), FramedChannel(address, "old")
        try:
            in_flight = asyncio.create_task(switching.call(ROUTING, mpb.GetRoutingInfoReq()))
            await held.wait()
            await bystander.call(ROUTING, mpb.GetRoutingInfoReq())
            auth.set_tokens(["old", "new"])  # step 1: the service accepts both
            switching.set_token("new")        # step 2: the client presents the new one
            await switching.call(ROUTING, mpb.GetRoutingInfoReq())  # on a new connection
            await bystander.call(ROUTING, mpb.GetRoutingInfoReq())  # the old token still works
            release.set()
            await in_flight  # answered on the connection it was sent on
            auth.set_tokens(["new"])  # finish
            await switching.call(ROUTING, mpb.GetRoutingInfoReq())
            with pytest.raises(Unauthenticated):
                await bystander.call(ROUTING, mpb.GetRoutingInfoReq())  # open, but with a dropped token
            fresh = FramedChannel(address, "old")
            with pytest.raises(Unauthenticated):
                await fresh.call(ROUTING, mpb.GetRoutingInfoReq())
            await fresh.close()
        finally:
            await switching.close()
            await bystander.close()
            await server.stop()
            await servicer.stop()
    asyncio.run(body())


def test_a_rotation_on_grpc_and_through_a_channel_factory() -> None:
    async def body() -> None:
        servicer = MgmtdServicer(MemKVStore(), MgmtdConfig(kv_engine="mem"))
        servicer.start()
        auth = Authenticator(["old"])
        dispatcher = Dispatcher(auth=auth)
        dispatcher.add_service(MGMTD, servicer)
        server = GrpcServer(dispatcher)
        address = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
        channels = RealChannelFactory("old", "grpc")
        stale = GrpcChannel(address, "old")
        try:
            await channels.get(address).call(ROUTING, mpb.GetRoutingInfoReq())
            await stale.call(ROUTING, mpb.GetRoutingInfoReq())
            auth.set_tokens(["old", "new"])
            channels.set_token("new")
            await channels.get(address).call(ROUTING, mpb.GetRoutingInfoReq())
            auth.set_tokens(["new"])
            await channels.get(address).call(ROUTING, mpb.GetRoutingInfoReq())
            with pytest.raises(Unauthenticated):
                await stale.call(ROUTING, mpb.GetRoutingInfoReq())
            assert "new" not in repr(channels)
        finally:
            await channels.close()
            await stale.close()
            await server.stop()
            await servicer.stop()
    asyncio.run(body())


# -- a local cluster ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """mgmtd, meta, two storage nodes (2-replica chains, so storage calls storage), and a FUSE
    mount when this machine has FUSE."""
    root = tmp_path_factory.mktemp("secrets") / "cluster"
    local = LocalCluster(root, storage_nodes=2, targets_per_node=1, heartbeat_timeout_ms=1_500)
    mountable = os.path.exists("/dev/fuse") and _has_pyfuse3()
    try:
        local.start_all()
        asyncio.run(local.ensure_chains(2))
        if mountable:
            local.set_mount(root.parent / "mnt")
            local.start("mount")
        local.write_cluster_json()
        with fs3.connect(local.mgmtd_address, token=local.token) as fs:
            fs.write_bytes("/big.bin", os.urandom(300_000))  # beyond inline_max_bytes: chunk files on disk
        yield local
    finally:
        local.stop_all()
        if local.mountpoint and os.path.ismount(local.mountpoint):
            subprocess.run(["fusermount3", "-uz", local.mountpoint], check=False)


def _has_pyfuse3() -> bool:
    try:
        import pyfuse3  # noqa: F401
    except ImportError:
        return False
    return True


def _pids(cluster: LocalCluster) -> dict[str, int]:
    pids = {}
    for name, proc in cluster.procs.items():
        assert proc.running, f"{name} is not running:\n{proc.log_tail()}"
        assert proc.pid is not None
        pids[name] = proc.pid
    return pids


def test_no_token_in_process_arguments_logs_or_the_environment(cluster: LocalCluster) -> None:
    token = cluster.token.encode()
    for name, pid in _pids(cluster).items():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert token not in cmdline, f"{name}'s arguments show the token"
        assert token not in Path(f"/proc/{pid}/environ").read_bytes(), f"{name}'s environment holds the token"
        if name == "mount":
            assert b"--token-file\0" in cmdline
    for log in cluster.root.glob("*.log"):
        assert token not in log.read_bytes(), f"{log} shows the token"
    info = json.loads((cluster.root / "cluster.json").read_text())
    assert "token" not in info and info["token_file"] == str(cluster.token_file)


def test_files_of_a_local_cluster_are_private(cluster: LocalCluster) -> None:
    root = cluster.root
    files = [p for p in root.rglob("*") if p.is_file()]
    directories = [root, *(p for p in root.rglob("*") if p.is_dir())]
    secrets = [root / "cluster.json", root / "token", *root.glob("*/*.toml")]
    assert len(secrets) == 2 + 4
    uid = os.geteuid()
    for path in secrets:
        assert _mode(path) == 0o600 and path.stat().st_uid == uid, path
    chunk_files = [p for p in (root / "storage-1" / "target-1" / "chunks").rglob("*") if p.is_file()]
    kv_files = [p for p in (root / "meta" / "kv").iterdir() if p.is_file()]
    assert chunk_files and kv_files
    loose = [f"{p} {_mode(p):04o}" for p in files if _mode(p) & 0o077]
    assert loose == [], "files other users may access"
    loose = [f"{p} {_mode(p):04o}" for p in directories if _mode(p) & 0o077]
    assert loose == [], "directories other users may enter"
    # And as a second local user: nothing opens, nothing lists.
    code = (
        "import json, os, sys\n"
        "paths = json.load(sys.stdin)\n"
        "opened = []\n"
        "for p in paths['files']:\n"
        "    try:\n"
        "        os.close(os.open(p, os.O_RDONLY)); opened.append(p)\n"
        "    except PermissionError:\n"
        "        pass\n"
        "for p in paths['dirs']:\n"
        "    try:\n"
        "        os.listdir(p); opened.append(p)\n"
        "    except PermissionError:\n"
        "        pass\n"
        "print(json.dumps(opened))\n"
    )
    done = subprocess.run(["/usr/bin/python3", "-c", code], input=json.dumps(
        {"files": [str(p) for p in files], "dirs": [str(p) for p in directories]}), capture_output=True, text=True,
        user=NOBODY, group=NOBODY, extra_groups=[], timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [], "readable by nobody"
    # Even with the cluster directory opened up, the data and secrets themselves stay closed.
    before = _mode(root)
    root.chmod(0o755)
    try:
        done = subprocess.run(["/usr/bin/python3", "-c", code], input=json.dumps(
            {"files": [str(p) for p in [*secrets, *chunk_files, *kv_files]],
             "dirs": [str(root / "storage-1" / "target-1"), str(root / "meta" / "kv")]}),
            capture_output=True, text=True, user=NOBODY, group=NOBODY, extra_groups=[], timeout=60, cwd="/")
    finally:
        root.chmod(before)
    assert done.returncode == 0 and json.loads(done.stdout) == [], done.stdout + done.stderr


def test_rotating_the_token_restarts_nothing_and_drops_the_old_token_at_finish(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    pids = _pids(cluster)
    old = cluster.token
    mgmtd = cluster.mgmtd_address
    with fs3.connect(mgmtd, token=old) as open_client:
        open_client.write_bytes("/before.txt", b"written before the rotation")
        assert main(["admin", "token", "rotate", "--dir", str(cluster.root)]) == 0
        out = capsys.readouterr().out
        new = cluster.token
        assert new != old and read_token_file(cluster.token_file) == [new, old]
        assert str(cluster.token_file) in out and new not in out and old not in out
        # A second rotation before finishing the first is refused, and changes nothing.
        assert main(["admin", "token", "rotate", "--dir", str(cluster.root)]) == 1
        assert "--finish" in capsys.readouterr().err and read_token_file(cluster.token_file) == [new, old]

        assert open_client.read_bytes("/before.txt") == b"written before the rotation"
        open_client.write_bytes("/during.txt", b"open client, old token")
        for token in (new, old):
            with fs3.connect(mgmtd, token=token) as fs:
                fs.write_bytes(f"/fresh-{token[:4]}.txt", os.urandom(200_000))  # replicated storage to storage
                assert fs.read_bytes("/during.txt") == b"open client, old token"
        mnt = Path(cluster.mountpoint) if cluster.mountpoint else None
        if mnt is not None:
            (mnt / "mount-during.txt").write_bytes(b"mount")
        assert main(["admin", "--dir", str(cluster.root), "--json", "nodes"]) == 0  # cluster.json -> new token
        assert all(n["alive"] for n in json.loads(capsys.readouterr().out))

        assert main(["admin", "token", "rotate", "--dir", str(cluster.root), "--finish"]) == 0
        assert read_token_file(cluster.token_file) == [new]
        out = capsys.readouterr().out
        assert str(cluster.token_file) in out and new not in out and old not in out
        with pytest.raises(PermissionError):  # its connections opened with a token no longer valid
            open_client.read_bytes("/before.txt")
    with pytest.raises(PermissionError):
        fs3.connect(mgmtd, token=old)
    # Services still reach each other (heartbeats, replication, meta to storage), with the new token.
    time.sleep(1.7)  # past the heartbeat timeout: a node whose heartbeats were refused is down by now
    assert main(["admin", "--dir", str(cluster.root), "--json", "targets"]) == 0
    targets = json.loads(capsys.readouterr().out)
    assert len(targets) == 2 and all(t["public_state"] == "serving" for t in targets), targets
    with fs3.connect(mgmtd, token=new) as fs:
        fs.write_bytes("/after.bin", os.urandom(200_000))
        assert fs.read_bytes("/during.txt") == b"open client, old token"
    if mnt is not None:
        (mnt / "mount-after.txt").write_bytes(b"still mounted")
        assert (mnt / "mount-during.txt").read_bytes() == b"mount"
    assert main(["admin", "token", "rotate", "--dir", str(cluster.root), "--finish"]) == 1  # nothing to finish
    assert _pids(cluster) == pids, "no process restarted"
    for log in cluster.root.glob("*.log"):
        text = log.read_text(errors="replace")
        assert old not in text and new not in text, f"{log} shows a token"
    assert "SIGHUP: 2 cluster token(s) loaded" in (cluster.root / "meta.log").read_text()


def test_a_pipe_planted_at_a_secret_path_is_refused_not_waited_on(tmp_path: Path) -> None:
    pipe = tmp_path / "token"
    os.mkfifo(pipe, 0o600)
    with pytest.raises(InvalidArgument, match="not a regular file"):
        read_token_file(pipe)
    # A directory at the path is named as the path, not as the descriptor it was opened on.
    directory = tmp_path / "token-dir"
    directory.mkdir(mode=0o700)
    with pytest.raises(InvalidArgument, match=f"secret file {directory} is not a regular file"):
        read_token_file(directory)


def test_a_bad_token_setting_is_reported_without_its_value(tmp_path: Path) -> None:
    config = tmp_path / "storage.toml"
    write_secret_file(config, 'node_id = 1\ntoken = ["s3cret-value"]\n')
    with pytest.raises(InvalidArgument) as refused:
        load_config(StorageConfig, str(config), env_prefix="FS3_STORAGE")
    assert "token" in refused.value.message and "s3cret-value" not in refused.value.message
