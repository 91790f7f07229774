"""Files that hold secrets, and directories that hold data: private to the user running fs3.

A cluster token in a file any local user can read makes every local user a service of the
cluster, and a chunk file any local user can read bypasses every permission check of the file
system. So, as ssh does with private keys:

- a secret file is created ``0600`` from the start (``os.open`` with that mode and ``O_EXCL``,
  never ``chmod`` after writing, which would leave a window where it is readable), and replaced
  atomically;
- a secret file is checked before it is used: one that group or others may access, or that
  another user owns, is refused with an error naming the file and the command that fixes it;
- data directories are ``0700`` and service processes run with umask ``077``, so whatever
  RocksDB and the chunk store create is private too.

A cluster's tokens live in a *token file*, one token per line: the first is the one a process
presents on the calls it makes, every line is accepted on the calls it serves. Two lines are a
rotation in progress (see ``fs3 admin token rotate``).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fs3.common.durable import make_dirs_durable, sync_dir
from fs3.common.errors import InvalidArgument, IoError

__all__ = ["PRIVATE_DIR_MODE", "PRIVATE_UMASK", "SECRET_FILE_MODE", "TokenSource", "check_config_file",
           "check_secret_file", "make_private_dir", "read_secret_file", "read_token_file", "set_private_umask",
           "write_secret_file", "write_token_file"]

SECRET_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
#: The umask of every service process: what it creates, only its user may read.
PRIVATE_UMASK = 0o077
#: A token is printable ASCII without spaces (it travels as gRPC metadata, which allows no more).
_TOKEN = re.compile(r"[\x21-\x7e]{1,512}")
#: Config keys that hold a secret (``token``, and any ``*_token``).
_SECRET_KEY = re.compile(r"(.+_)?token")


def set_private_umask() -> None:
    """Make everything this process creates from now on private to its user."""
    os.umask(PRIVATE_UMASK)


def _check_stat(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"{path} holds a secret but is not a regular file")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise InvalidArgument(f"{path} holds a secret but is owned by uid {st.st_uid}, not uid {uid} that runs "
                              f"this process; fix: chown {uid} {path} && chmod 600 {path}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise InvalidArgument(f"{path} holds a secret but its mode is {mode:04o}: other users may read or change "
                              f"it; fix: chmod 600 {path}")


def check_secret_file(path: str | os.PathLike[str]) -> None:
    """Refuse a secret file that group or others may access, or that another user owns."""
    file = Path(path)
    try:
        st = file.stat()
    except FileNotFoundError:
        raise InvalidArgument(f"secret file {file} does not exist") from None
    except OSError as exc:
        raise InvalidArgument(f"secret file {file}: {exc.strerror or exc}") from None
    _check_stat(file, st)


def read_secret_file(path: str | os.PathLike[str]) -> str:
    """The text of a secret file, after the check (made on the open file, so it is the one read)."""
    file = Path(path)
    try:
        # Non-blocking, so that a pipe planted at the path cannot hang the start; a regular file only.
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InvalidArgument(f"secret file {file} does not exist") from None
    except OSError as exc:
        raise InvalidArgument(f"secret file {file}: {exc.strerror or exc}") from None
    try:
        # Checked before the descriptor becomes a file object: opening a directory that way fails
        # with an error that names the descriptor, not the path.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"secret file {file} is not a regular file")
        _check_stat(file, st)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(64 * 1024 + 1)
    if len(raw) > 64 * 1024:
        raise InvalidArgument(f"secret file {file} is larger than 64 KiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"secret file {file} is not UTF-8 text") from None


def write_secret_file(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text``, readable by this user only from the moment it exists.

    Written to a new file created ``0600`` beside it, synced, then renamed over it: a reader sees
    the old content or the new, never a mix, and never a moment where the file is readable by
    others. (An existing file's mode is not inherited: the new one is ``0600`` whatever it was.)
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, SECRET_FILE_MODE)
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        sync_dir(target.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise IoError(f"writing {target}: {exc.strerror or exc}") from None


def read_token_file(path: str | os.PathLike[str]) -> list[str]:
    """The tokens of a token file (one a line, blank lines ignored), first the one to present."""
    tokens: list[str] = []
    for number, line in enumerate(read_secret_file(path).splitlines(), 1):
        token = line.strip()
        if not token:
            continue
        if not _TOKEN.fullmatch(token):
            # Never quote the line: it may be a token with a typo in it.
            raise InvalidArgument(f"token file {path}, line {number}: a token is 1-512 printable ASCII "
                                  "characters without spaces")
        tokens.append(token)
    if not tokens:
        raise InvalidArgument(f"token file {path} holds no token")
    return tokens


def write_token_file(path: str | os.PathLike[str], tokens: Sequence[str]) -> None:
    """Replace a token file (``0600``) with ``tokens``, first the one to present."""
    for token in tokens:
        if not _TOKEN.fullmatch(token):
            raise InvalidArgument("a token is 1-512 printable ASCII characters without spaces")
    if not tokens:
        raise InvalidArgument("a token file needs at least one token")
    write_secret_file(path, "".join(f"{t}\n" for t in tokens))


def check_config_file(path: str | os.PathLike[str] | None) -> None:
    """Refuse a config file that holds a secret (``token``, ``*_token``) and is not private."""
    if path is None:
        return
    try:
        with Path(path).open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError):
        return  # the config loader reports it
    if any(_SECRET_KEY.fullmatch(key) and value for key, value in data.items()):
        check_secret_file(path)


def make_private_dir(path: str | os.PathLike[str]) -> None:
    """``mkdir -p`` (durably), then make the directory ``0700`` if it was more open (one made by
    an earlier release): its files are the cluster's data, for no other local user.

    A directory another user owns is refused, whatever its mode: its owner may open it again,
    and rename, replace or plant entries in it (a config, a CA the process would then use) — the
    directory a local user made in advance at a predictable path (``/tmp/fs3``)."""
    directory = Path(path)
    make_dirs_durable(directory)
    try:
        st = directory.stat()
        uid = os.geteuid()
        if st.st_uid != uid:
            raise InvalidArgument(f"{directory} is owned by uid {st.st_uid}, not uid {uid} that runs this process: "
                                  f"its owner could change what is in it; use a directory of your own (or chown "
                                  f"{uid} {directory})")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            directory.chmod(PRIVATE_DIR_MODE)
    except OSError as exc:
        raise IoError(f"making {directory} private: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class TokenSource:
    """Where a service finds its cluster tokens: inline in its config (``token``), or in a token
    file (``token_file``) that it reads again on SIGHUP, so that tokens rotate without a restart.
    ``trusted_token_file`` lists trusted-client tokens (mount daemons that act for their callers:
    client methods only), read again on SIGHUP too."""

    token: str = ""
    token_file: str = ""
    trusted_token_file: str = ""

    def __post_init__(self) -> None:
        if self.token and self.token_file:
            raise InvalidArgument("set token or token_file, not both")

    def __repr__(self) -> str:  # never print a secret
        return f"TokenSource(token_file={self.token_file!r}, inline={'yes' if self.token else 'no'})"

    @property
    def reloadable(self) -> bool:
        return bool(self.token_file or self.trusted_token_file)

    def load(self) -> list[str]:
        """Every valid token, first the one to present; ``[]`` when none is configured (an open
        cluster: in-process tests only)."""
        if self.token_file:
            return read_token_file(self.token_file)
        return [self.token] if self.token else []

    def load_trusted(self) -> list[str]:
        """The trusted-client tokens; ``[]`` when no file is configured."""
        return read_token_file(self.trusted_token_file) if self.trusted_token_file else []
