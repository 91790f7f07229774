"""Where a client finds its cluster and token without arguments: profiles, FS3_* and URLs (no cluster)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from fs3.client.fs import ClientConfig, client_config
from fs3.client.fsspec_impl import FS3FileSystem
from fs3.client.profiles import ClusterSettings, Profile, config_path, load_profiles, resolve, save_profile
from fs3.common.errors import InvalidArgument
from fs3.common.secret_files import write_token_file
from fs3.rpc.tls import TlsConfig

TOKEN_A = "a-token-0123456789abcdef"
TOKEN_B = "b-token-0123456789abcdef"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A config directory with a default profile (token by file) and a second one (token inline)."""
    config = tmp_path / "config.toml"
    write_token_file(tmp_path / "a.token", [TOKEN_A])
    config.write_text(
        "# my clusters\n"
        "[profiles.default]\n"
        'mgmtd = "10.0.0.1:9000"\n'
        'token_file = "a.token"          # next to this file\n'
        "\n"
        "[profiles.train]\n"
        'mgmtd = ["10.0.0.2:9000", "10.0.0.3:9000"]\n'
        f'token = "{TOKEN_B}"\n'
        'transport = "grpc"\n'
        "[profiles.train.tls]\n"
        'ca_file = "ca.pem"\n'
        'cert_file = "/etc/fs3/client.pem"\n'
        'key_file = "/etc/fs3/client.key"\n')
    config.chmod(0o600)
    return tmp_path


def env_for(home: Path, **extra: str) -> dict[str, str]:
    return {"FS3_CONFIG": str(home / "config.toml"), **extra}


def test_the_default_profile_gives_cluster_and_token(home: Path) -> None:
    settings = resolve(environ=env_for(home))
    assert settings.mgmtd == ("10.0.0.1:9000",) and settings.token == TOKEN_A
    assert settings.token_file == str(home / "a.token") and settings.profile == "default"
    assert TOKEN_A not in repr(settings)


def test_a_named_profile_with_its_transport_and_tls(home: Path) -> None:
    settings = resolve(profile="train", environ=env_for(home))
    assert settings.mgmtd == ("10.0.0.2:9000", "10.0.0.3:9000") and settings.token == TOKEN_B
    assert settings.transport == "grpc"
    assert settings.tls == TlsConfig(ca_file=str(home / "ca.pem"), cert_file="/etc/fs3/client.pem",
                                     key_file="/etc/fs3/client.key")
    config = client_config(settings, None, {})
    assert config.transport == "grpc" and config.tls == settings.tls
    # What the caller sets wins over the profile; an explicit config still gets the profile's TLS.
    assert client_config(settings, None, {"transport": "framed"}).transport == "framed"
    assert client_config(settings, ClientConfig(), {}).tls == settings.tls
    assert resolve(profile="train", environ=env_for(home, FS3_PROFILE="default")).profile == "train"
    assert resolve(environ=env_for(home, FS3_PROFILE="train")).token == TOKEN_B


def test_precedence_caller_then_named_profile_then_environment_then_profile(home: Path) -> None:
    env = env_for(home, FS3_MGMTD="10.9.9.9:9000", FS3_TOKEN="env-token")
    # The environment beats the default profile...
    settings = resolve(environ=env)
    assert settings.mgmtd == ("10.9.9.9:9000",) and settings.token == "env-token" and settings.profile is None
    # ...a profile the caller names beats the environment...
    settings = resolve(profile="train", environ=env)
    assert settings.mgmtd[0] == "10.0.0.2:9000" and settings.token == TOKEN_B
    # ...and what the caller passes beats everything.
    settings = resolve("10.5.5.5:9000", "mine", profile="train", environ=env)
    assert settings.mgmtd == ("10.5.5.5:9000",) and settings.token == "mine"
    settings = resolve("10.5.5.5:9000", environ=env)
    assert settings.token == "env-token"


def test_a_profile_token_never_goes_to_another_cluster(home: Path) -> None:
    # FS3_MGMTD names another cluster: the default profile's token is not sent there.
    settings = resolve(environ=env_for(home, FS3_MGMTD="10.9.9.9:9000"))
    assert settings.mgmtd == ("10.9.9.9:9000",) and settings.token is None and settings.tls is None
    assert resolve("10.9.9.9:9000", environ=env_for(home)).token is None
    # The profile's own cluster, named by address (a fs3://HOST:PORT/ URL), gets its token.
    assert resolve("10.0.0.1:9000", environ=env_for(home)).token == TOKEN_A


def test_token_file_in_the_environment(home: Path) -> None:
    write_token_file(home / "env.token", ["from-file"])
    settings = resolve(environ=env_for(home, FS3_MGMTD="h:1", FS3_TOKEN_FILE=str(home / "env.token")))
    assert settings.token == "from-file" and settings.token_file == str(home / "env.token")
    with pytest.raises(InvalidArgument, match="FS3_TOKEN or FS3_TOKEN_FILE"):
        resolve(environ=env_for(home, FS3_TOKEN="x", FS3_TOKEN_FILE=str(home / "env.token")))
    with pytest.raises(InvalidArgument, match="not both"):
        resolve("h:1", "x", token_file=str(home / "env.token"), environ={})


def test_tls_from_the_environment_unless_the_profile_has_its_own(home: Path) -> None:
    """``FS3_TLS_*`` as the ``fs3`` command and the compose file's clients set them."""
    tls_env = {"FS3_TLS_CA_FILE": "/certs/ca.pem", "FS3_TLS_CERT_FILE": "/certs/client.pem",
               "FS3_TLS_KEY_FILE": "/certs/client.key"}
    settings = resolve(environ=env_for(home, FS3_MGMTD="h:1", FS3_TOKEN="x", **tls_env))
    assert settings.tls == TlsConfig(ca_file="/certs/ca.pem", cert_file="/certs/client.pem",
                                     key_file="/certs/client.key")
    assert client_config(settings, None, {}).tls == settings.tls
    assert resolve("h:2", "x", environ=env_for(home, **tls_env)).tls == settings.tls
    # The profile in use keeps its own TLS; none anywhere is no TLS.
    own = resolve(profile="train", environ=env_for(home, **tls_env)).tls
    assert own is not None and own.cert_file == "/etc/fs3/client.pem"
    assert resolve(environ=env_for(home, FS3_MGMTD="h:1", FS3_TOKEN="x")).tls is None
    for broken, message in (({"FS3_TLS_CERT_FILE": "/c.pem"}, "cert_file and key_file"),
                            ({"FS3_TLS_SERVER_NAME": "fs3"}, "ca_file is required")):
        with pytest.raises(InvalidArgument, match=message):
            resolve(environ=env_for(home, FS3_MGMTD="h:1", FS3_TOKEN="x", **broken))


def test_a_config_with_an_inline_token_must_be_private(home: Path) -> None:
    (home / "config.toml").chmod(0o644)
    with pytest.raises(InvalidArgument, match="chmod 600") as caught:
        resolve(environ=env_for(home))
    assert TOKEN_B not in str(caught.value)
    # Without an inline token, a readable config is fine (the token file itself is checked).
    (home / "open.toml").write_text('[profiles.default]\nmgmtd = "h:1"\ntoken_file = "a.token"\n')
    (home / "open.toml").chmod(0o644)
    assert resolve(environ={"FS3_CONFIG": str(home / "open.toml")}).token == TOKEN_A
    (home / "a.token").chmod(0o644)
    with pytest.raises(InvalidArgument, match=r"a\.token holds a secret"):
        resolve(environ={"FS3_CONFIG": str(home / "open.toml")})


@pytest.mark.parametrize(("text", "message"), [
    ('[profiles.default]\nmgmtd = "h:1"\ntokn_file = "t"\n', "unknown key"),
    ('[profiles.default]\ntoken_file = "t"\n', "mgmtd must be"),
    ('[profiles.default]\nmgmtd = "h:1"\ntransport = "udp"\n', "transport must be"),
    ('[profiles.default]\nmgmtd = "h:1"\n[profiles.default.tls]\ncert_file = "c"\nkey_file = "k"\n', "ca_file"),
    ('[profiles.default]\nmgmtd = "h:1"\ntoken = "x"\ntoken_file = "t"\n', "not both"),
    ('mgmtd = "h:1"\n', "unknown top-level"),
    ("[profiles.default\n", "not valid TOML"),
])
def test_a_bad_config_is_refused_with_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(text)
    config.chmod(0o600)
    with pytest.raises(InvalidArgument, match=message):
        resolve(environ={"FS3_CONFIG": str(config)})


def test_missing_things_are_named(home: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="no profile 'nope'"):
        resolve(profile="nope", environ=env_for(home))
    with pytest.raises(InvalidArgument, match="no profile 'nope'"):
        resolve(environ=env_for(home, FS3_PROFILE="nope"))
    with pytest.raises(InvalidArgument, match="FS3_CONFIG names"):
        resolve(environ={"FS3_CONFIG": str(tmp_path / "absent.toml")})
    with pytest.raises(InvalidArgument, match=r"no cluster given.*FS3_MGMTD"):
        resolve(environ={"HOME": str(tmp_path)})
    # A pipe planted where the config goes is refused, not waited on.
    os.mkfifo(tmp_path / "fifo.toml")
    with pytest.raises(InvalidArgument, match="not a regular file"):
        resolve(environ={"FS3_CONFIG": str(tmp_path / "fifo.toml")})


def test_the_config_file_location() -> None:
    assert config_path({"HOME": "/home/u"}) == Path("/home/u/.config/fs3/config.toml")
    assert config_path({"HOME": "/home/u", "XDG_CONFIG_HOME": "/x"}) == Path("/x/fs3/config.toml")
    assert config_path({"HOME": "/home/u", "FS3_CONFIG": "/c.toml"}) == Path("/c.toml")


def test_settings_pickle_a_token_file_as_its_path(home: Path) -> None:
    from_file = resolve(environ=env_for(home))
    data = pickle.dumps(from_file)
    assert TOKEN_A.encode() not in data
    assert pickle.loads(data).token == TOKEN_A  # read again where it is unpickled
    inline = ClusterSettings(("h:1",), "inline-token-value")
    assert pickle.loads(pickle.dumps(inline)).token == "inline-token-value"


def test_urls_name_a_profile() -> None:
    assert FS3FileSystem._get_kwargs_from_urls("fs3://train@/data/x") == {"profile": "train"}
    assert FS3FileSystem._get_kwargs_from_urls("fs3:///data/x") == {}
    assert FS3FileSystem._get_kwargs_from_urls("fs3://h:9000/data/x") == {"mgmtd": "h:9000"}
    assert FS3FileSystem._strip_protocol("fs3://train@/data/x") == "/data/x"
    assert FS3FileSystem._strip_protocol("fs3:///data/x") == "/data/x"


def test_save_profile_keeps_the_rest_of_the_file(home: Path) -> None:
    config = home / "config.toml"
    local = Profile("local", ("127.0.0.1:4000",), token_file=str(home / "local.token"))
    save_profile(config, local)
    text = config.read_text()
    assert "# my clusters" in text and "# next to this file" in text
    profiles = load_profiles(config)
    assert profiles["local"] == local and profiles["train"].token == TOKEN_B
    assert oct(config.stat().st_mode & 0o777) == "0o600"
    # Saving it again replaces it (with its tls table), and nothing else.
    tls = TlsConfig(ca_file="/c/ca.pem", cert_file="/c/client.pem", key_file="/c/client.key")
    again = Profile("local", ("127.0.0.1:5000",), token_file=str(home / "local.token"), tls=tls)
    save_profile(config, again)
    save_profile(config, again)
    profiles = load_profiles(config)
    assert profiles["local"] == again and set(profiles) == {"default", "train", "local"}
    assert config.read_text().count("[profiles.local]") == 1


def test_save_profile_refuses_what_it_cannot_edit_safely(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    original = 'profiles.local = { mgmtd = "h:1" }\n'
    config.write_text(original)
    with pytest.raises(InvalidArgument, match="edit the file by hand"):
        save_profile(config, Profile("local", ("h:2",), token_file="/t"))
    assert config.read_text() == original
    with pytest.raises(InvalidArgument, match="never a token"):
        save_profile(config, Profile("x", ("h:2",), token="secret"))
    with pytest.raises(InvalidArgument, match="profile name"):
        save_profile(config, Profile("a b]", ("h:2",), token_file="/t"))


def test_a_local_cluster_writes_a_profile_for_itself(tmp_path: Path) -> None:
    from fs3.cli.local import LocalCluster

    cluster = LocalCluster(tmp_path / "cluster", storage_nodes=1, targets_per_node=1)
    cluster.mgmtd_port = 4321  # as once mgmtd has started
    config = tmp_path / "home" / "config.toml"
    assert cluster.save_profile("dev", config) == config
    settings = resolve(environ={"FS3_CONFIG": str(config), "FS3_PROFILE": "dev"})
    assert settings.mgmtd == ("127.0.0.1:4321",) and settings.token == cluster.token
    assert cluster.token not in config.read_text()  # by file, never inline


def test_local_up_refuses_a_bad_profile_name_before_starting_anything(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fs3.cli.main", "local", "up", "--dir", str(tmp_path / "c"),
                           "--profile", "no good", "--detach"], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode != 0 and "profile name 'no good'" in done.stderr
    assert not (tmp_path / "c").exists()
