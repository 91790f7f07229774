"""Where a client finds its cluster and token when the code names neither: profiles and the environment.

Code that only has a URL — torch's checkpointer, which rebuilds its file system from
``fs3://...`` alone, a DataLoader worker, a notebook — cannot be handed a token. So, as cloud SDKs
do, a client resolves what the caller left out from one standard place, in this order (the first
that gives a value wins; docs/operations.md, "Connecting: profiles and environment"):

1. What the caller passes: ``fs3.connect("HOST:PORT", token=... | token_file=...)``, fsspec's
   ``mgmtd=``/``token=``, a ``fs3://HOST:PORT/path`` URL.
2. A profile the caller names: ``fs3.connect(profile="NAME")``, ``fs3://NAME@/path``.
3. The environment: ``FS3_MGMTD``, ``FS3_TOKEN`` or ``FS3_TOKEN_FILE``; mutual TLS from
   ``FS3_TLS_CA_FILE``, ``FS3_TLS_CERT_FILE``, ``FS3_TLS_KEY_FILE`` (and ``FS3_TLS_SERVER_NAME``), as
   the ``fs3`` command reads them, unless the profile in use has TLS settings of its own.
4. The profile ``FS3_PROFILE`` names, else ``default``, in the config file: ``$FS3_CONFIG``, else
   ``$XDG_CONFIG_HOME/fs3/config.toml`` (``~/.config/fs3/config.toml``)::

       [profiles.default]
       mgmtd = "10.0.0.1:9000"            # or a list of mgmtd addresses
       token_file = "~/.fs3/token"        # relative paths are from the config file's directory
       transport = "framed"               # or "grpc"
       [profiles.default.tls]             # mutual TLS: as the services' [tls] table
       ca_file = "ca.pem"
       cert_file = "client.pem"
       key_file = "client.key"

A profile's token (and its transport and TLS settings) is used only for the profile's own mgmtd,
even when the caller names the profile (``fs3://NAME@HOST:PORT/`` with another HOST is refused): a
token never goes to a cluster it was not configured for.
A config file that holds a token inline (``token = "..."``) must be private (``0600``, yours), as a
token file must; any other may be readable by others, never writable by them (nor owned by another
user than you or root), since it says where a token goes.
"""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fs3.common.errors import InvalidArgument
from fs3.common.secret_files import read_secret_file, read_token_file
from fs3.rpc.tls import TlsConfig

__all__ = ["ClusterSettings", "Profile", "check_profile_name", "config_path", "load_profiles", "resolve",
           "save_profile"]

_CONFIG_MAX_BYTES = 1 << 20
_PROFILE_KEYS = frozenset({"mgmtd", "token", "token_file", "transport", "tls"})
_TLS_KEYS = frozenset({"ca_file", "cert_file", "key_file", "server_name"})
_TRANSPORTS = ("framed", "grpc")


@dataclass(frozen=True)
class Profile:
    """One ``[profiles.NAME]`` table, its paths made absolute."""

    name: str
    mgmtd: tuple[str, ...]
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    transport: str | None = None
    tls: TlsConfig | None = None


@dataclass(frozen=True)
class ClusterSettings:
    """What a client connects with: where mgmtd is, and the token (with the file it came from).

    ``token_file`` is kept so that a pickled client (a ``spawn`` DataLoader worker) carries the
    file's path and reads the token again, rather than the token itself.
    """

    mgmtd: tuple[str, ...]
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    profile: str | None = None
    transport: str | None = None
    tls: TlsConfig | None = None
    source: str = "arguments"

    def __repr__(self) -> str:  # never print a secret
        return (f"ClusterSettings(mgmtd={list(self.mgmtd)!r}, token={'set' if self.token else 'none'}, "
                f"token_file={self.token_file!r}, profile={self.profile!r}, source={self.source!r})")

    def __getstate__(self) -> dict[str, Any]:
        """A token read from a file travels as the file's path, read again where it is unpickled."""
        state = dict(self.__dict__)
        if self.token_file:
            state["token"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state.get("token_file") and state.get("token") is None:
            state = {**state, "token": read_token_file(state["token_file"])[0]}
        for key, value in state.items():
            object.__setattr__(self, key, value)


def config_path(environ: Mapping[str, str] | None = None) -> Path:
    """The config file clients read: ``$FS3_CONFIG``, else ``$XDG_CONFIG_HOME/fs3/config.toml``
    (``~/.config/fs3/config.toml``)."""
    env = os.environ if environ is None else environ
    if env.get("FS3_CONFIG"):
        return Path(env["FS3_CONFIG"]).expanduser()
    base = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else Path(env.get("HOME") or
                                                                                   Path.home()) / ".config"
    return base / "fs3" / "config.toml"


def _read_config_text(path: Path) -> str | None:
    """The config file's text, or None when there is none (see :func:`_read_config`)."""
    read = _read_config(path)
    return None if read is None else read[0]


def _read_config(path: Path) -> tuple[str, os.stat_result] | None:
    """The config file's text and the status of the very file it was read from, or None when there
    is none. Opened non-blocking (a pipe planted at the path cannot hang a client) and only if it
    is a regular file; the status comes from the open descriptor, so a path swapped after the read
    cannot pass its owner and mode off as the text's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InvalidArgument(f"fs3 config {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as fh:
        status = os.fstat(fh.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise InvalidArgument(f"fs3 config {path} is not a regular file")
        raw = fh.read(_CONFIG_MAX_BYTES + 1)
    if len(raw) > _CONFIG_MAX_BYTES:
        raise InvalidArgument(f"fs3 config {path} is larger than 1 MiB")
    try:
        return raw.decode("utf-8"), status
    except UnicodeDecodeError:
        raise InvalidArgument(f"fs3 config {path} is not UTF-8 text") from None


def _parse(path: Path, text: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"fs3 config {path}: not valid TOML: {exc}") from None
    unknown = set(data) - {"profiles"}
    if unknown:
        raise InvalidArgument(f"fs3 config {path}: unknown top-level key(s) {', '.join(sorted(unknown))} "
                              "(profiles go in [profiles.NAME] tables)")
    profiles = data.get("profiles", {})
    if not isinstance(profiles, dict) or not all(isinstance(p, dict) for p in profiles.values()):
        raise InvalidArgument(f"fs3 config {path}: profiles must be tables ([profiles.NAME])")
    return profiles


def _path_setting(base: Path, value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{what} must be a non-empty string (a path)")
    return str(base / Path(value).expanduser())


def _profile(path: Path, name: str, table: dict[str, Any]) -> Profile:
    what = f"fs3 config {path}, profile {name!r}"
    unknown = set(table) - _PROFILE_KEYS
    if unknown:
        raise InvalidArgument(f"{what}: unknown key(s) {', '.join(sorted(unknown))} "
                              f"(known: {', '.join(sorted(_PROFILE_KEYS))})")
    mgmtd = table.get("mgmtd")
    addresses = [mgmtd] if isinstance(mgmtd, str) else mgmtd
    if not isinstance(addresses, list) or not addresses or not all(isinstance(a, str) and a for a in addresses):
        raise InvalidArgument(f"{what}: mgmtd must be \"HOST:PORT\" or a list of them")
    if "token" in table and "token_file" in table:
        raise InvalidArgument(f"{what}: set token or token_file, not both")
    token = table.get("token")
    if token is not None and (not isinstance(token, str) or not token):
        raise InvalidArgument(f"{what}: token must be a non-empty string")  # never quote the value
    base = path.parent
    token_file = _path_setting(base, table["token_file"], f"{what}: token_file") if "token_file" in table else None
    transport = table.get("transport")
    if transport is not None and transport not in _TRANSPORTS:
        raise InvalidArgument(f"{what}: transport must be one of {', '.join(_TRANSPORTS)}, not {transport!r}")
    tls = None
    if "tls" in table:
        tls_table = table["tls"]
        if not isinstance(tls_table, dict) or set(tls_table) - _TLS_KEYS:
            raise InvalidArgument(f"{what}: tls must be a table of {', '.join(sorted(_TLS_KEYS))}")
        settings = {key: (value if key == "server_name" else _path_setting(base, value, f"{what}: tls.{key}"))
                    for key, value in tls_table.items()}
        tls = TlsConfig(**settings)
        try:
            tls.validate()
        except InvalidArgument as exc:
            raise InvalidArgument(f"{what}: {exc.message}") from None
    return Profile(name, tuple(addresses), token, token_file, transport, tls)


def _load_tables(path: Path) -> dict[str, Any]:
    """The ``[profiles.*]`` tables of the config file at ``path`` ({} when there is no file).

    A file with a token inline is read again through the secret-file check (private, yours), and
    that checked text is what is used.
    """
    read = _read_config(path)
    if read is None:
        return {}
    text, status = read
    tables = _parse(path, text)
    if any("token" in table for table in tables.values()):
        tables = _parse(path, read_secret_file(path))
    elif tables:
        _check_unchangeable_by_others(path, status)
    return tables


def _check_unchangeable_by_others(path: Path, st: os.stat_result) -> None:
    """A config says where a token goes (its token file's, or ``$FS3_TOKEN`` to its mgmtd): it may
    be read by others, never changed by them (as ssh treats its config), or whoever may change it
    points the profile's mgmtd at a host of theirs and gets the token. ``st`` is the status of the
    file the text was read from."""
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        raise InvalidArgument(f"fs3 config {path} is owned by uid {st.st_uid}, not uid "
                              f"{uid} that runs this process; fix: chown {uid} {path} && chmod 644 {path}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise InvalidArgument(f"fs3 config {path} has mode {mode:04o}: other users may "
                              f"change where the token goes; fix: chmod go-w {path}")


def load_profiles(path: Path) -> dict[str, Profile]:
    """Every profile of the config file at ``path``, each checked ({} when there is no file)."""
    return {name: _profile(path, name, table) for name, table in _load_tables(path).items()}


def _token_of(token: str | None, token_file: str | None) -> str | None:
    return read_token_file(token_file)[0] if token_file else token


def resolve(mgmtd: str | list[str] | tuple[str, ...] | None = None, token: str | None = None, *,
            token_file: str | None = None, profile: str | None = None,
            environ: Mapping[str, str] | None = None) -> ClusterSettings:
    """The cluster and token to connect with, by the order of this module's docstring."""
    env = os.environ if environ is None else environ
    if token and token_file:
        raise InvalidArgument("give token or token_file, not both")
    if env.get("FS3_TOKEN") and env.get("FS3_TOKEN_FILE"):
        raise InvalidArgument("set FS3_TOKEN or FS3_TOKEN_FILE, not both")
    named_by_caller = bool(profile)
    name = profile or env.get("FS3_PROFILE") or "default"
    path = config_path(env)
    if env.get("FS3_CONFIG") and not path.exists():
        raise InvalidArgument(f"FS3_CONFIG names {path}, which does not exist")
    table = _load_tables(path).get(name)
    chosen = _profile(path, name, table) if table is not None else None  # only the one in use is checked
    if chosen is None and (named_by_caller or env.get("FS3_PROFILE")):
        raise InvalidArgument(f"no profile {name!r} in {path}")

    if mgmtd:
        addresses: tuple[str, ...] = (mgmtd,) if isinstance(mgmtd, str) else tuple(mgmtd)
        source = "arguments"
    elif named_by_caller:
        assert chosen is not None
        addresses, source = chosen.mgmtd, f"profile {name!r} in {path}"
    elif env.get("FS3_MGMTD"):
        addresses = tuple(a.strip() for a in env["FS3_MGMTD"].split(",") if a.strip())
        source = "FS3_MGMTD"
        if not addresses:
            raise InvalidArgument(f"FS3_MGMTD={env['FS3_MGMTD']!r} names no address (HOST:PORT[,HOST:PORT...])")
    elif chosen is not None:
        addresses, source = chosen.mgmtd, f"profile {name!r} in {path}"
    else:
        raise InvalidArgument(
            f"fs3: no cluster given: pass mgmtd='HOST:PORT' (or a fs3://HOST:PORT/ URL), name a profile "
            f"(profile='NAME', fs3://NAME@/path), set FS3_MGMTD, or add [profiles.{name}] to {path}")
    # The profile speaks for this connection only for its own cluster (every address one of its own),
    # whether the caller named it or not: ``fs3://prod@HOST:PORT/`` must not carry prod's token to HOST.
    trusted = chosen if chosen is not None and set(addresses) <= set(chosen.mgmtd) else None
    if named_by_caller and trusted is None and not (token or token_file):
        assert chosen is not None
        raise InvalidArgument(f"profile {name!r} is for mgmtd {', '.join(chosen.mgmtd)}, not "
                              f"{', '.join(addresses)}: its token is not sent to another cluster (drop the "
                              "address to use the profile's, or pass that cluster's own token)")
    if token or token_file:
        secret, secret_file = token, token_file
    elif named_by_caller and trusted is not None:
        secret, secret_file = trusted.token, trusted.token_file
    elif env.get("FS3_TOKEN") or env.get("FS3_TOKEN_FILE"):
        secret, secret_file = env.get("FS3_TOKEN") or None, env.get("FS3_TOKEN_FILE") or None
    elif trusted is not None:
        secret, secret_file = trusted.token, trusted.token_file
    else:
        secret, secret_file = None, None
    tls = trusted.tls if trusted is not None and trusted.tls is not None else _environment_tls(env)
    return ClusterSettings(addresses, _token_of(secret, secret_file), secret_file,
                           trusted.name if trusted is not None else None,
                           trusted.transport if trusted is not None else None, tls, source)


def _environment_tls(env: Mapping[str, str]) -> TlsConfig | None:
    """``FS3_TLS_<KEY>`` (what the ``fs3`` command and the compose file's clients set); None when unset."""
    settings = {key: env[f"FS3_TLS_{key.upper()}"] for key in sorted(_TLS_KEYS) if env.get(f"FS3_TLS_{key.upper()}")}
    if not settings:
        return None
    tls = TlsConfig(**settings)
    try:
        tls.validate()
    except InvalidArgument as exc:
        raise InvalidArgument(f"FS3_TLS_* in the environment: {exc}") from None
    if not tls.enabled:
        raise InvalidArgument("FS3_TLS_* in the environment: FS3_TLS_CA_FILE is needed to turn TLS on")
    return tls


def _toml_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    if any(ord(c) < 0x20 for c in escaped):
        raise InvalidArgument("a profile setting may not hold control characters")
    return f'"{escaped}"'


def _profile_text(profile: Profile) -> str:
    lines = [f"[profiles.{profile.name}]",
             "mgmtd = " + (_toml_string(profile.mgmtd[0]) if len(profile.mgmtd) == 1 else
                           "[" + ", ".join(_toml_string(a) for a in profile.mgmtd) + "]")]
    if profile.token_file:
        lines.append(f"token_file = {_toml_string(profile.token_file)}")
    if profile.transport:
        lines.append(f"transport = {_toml_string(profile.transport)}")
    if profile.tls is not None:
        lines.append(f"[profiles.{profile.name}.tls]")
        for key in ("ca_file", "cert_file", "key_file", "server_name"):
            value = getattr(profile.tls, key)
            if value:
                lines.append(f"{key} = {_toml_string(value)}")
    return "\n".join(lines) + "\n"


def check_profile_name(name: str) -> None:
    """A name that is a bare TOML key and the user part of a URL: letters, digits, ``-``, ``_``."""
    if not name or not name.replace("-", "").replace("_", "").isascii() or \
            not name.replace("-", "").replace("_", "").isalnum():
        raise InvalidArgument(f"profile name {name!r}: use letters, digits, '-' and '_'")


def save_profile(path: Path, profile: Profile) -> None:
    """Add ``profile`` to the config file at ``path`` (made ``0600``), or replace the profile of that
    name: the rest of the file is kept as it is, comments included.

    Never writes a token inline (only ``token_file``). A file the change cannot be made in safely
    (not valid TOML, or a profile written another way than as a ``[profiles.NAME]`` table) is
    refused and left as it was.
    """
    if profile.token:
        raise InvalidArgument("save_profile writes a token_file, never a token")
    check_profile_name(profile.name)
    from fs3.common.secret_files import write_secret_file

    text = _read_config_text(path) or ""
    tables = _parse(path, text) if text else {}
    header, sub = f"[profiles.{profile.name}]", f"[profiles.{profile.name}."
    kept: list[str] = []
    skipping = False
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("["):
            skipping = stripped == header or stripped.startswith(sub)
        if not skipping:
            kept.append(line)
    new = "".join(kept)
    if new and not new.endswith("\n"):
        new += "\n"
    new += ("\n" if new.strip() else "") + _profile_text(profile)
    refusal = InvalidArgument(f"fs3 config {path}: profile {profile.name!r} is not written as a "
                              f"[profiles.{profile.name}] table there; edit the file by hand")
    try:
        written = _parse(path, new)
        same = _profile(path, profile.name, written[profile.name]) == profile
    except (InvalidArgument, KeyError):
        raise refusal from None
    others = {name: table for name, table in written.items() if name != profile.name}
    if not same or others != {name: table for name, table in tables.items() if name != profile.name}:
        raise refusal
    path.parent.mkdir(parents=True, exist_ok=True)
    write_secret_file(path, new)
