"""``fs3 admin upgrade``: migrate a stopped service's stores to this release's formats, offline.

    fs3 admin upgrade --config SERVICE.toml [--service mgmtd|storage|meta] [--check] [--json]

The config is the service's own (what ``fs3 mgmtd|storage|meta --config`` reads); the service is
the one it describes (``--service`` when that is ambiguous). ``--check`` reports each store's
format and the migrations it would run, and changes nothing (RocksDB stores are opened
read-only). Without it every store is migrated as the service would at start (the way to
upgrade with ``upgrade_on_start = false``). A RocksDB store can be opened by one process only:
stop the service first. On PostgreSQL too, stop the servers of the older release first: they
do not read format records, and would go on writing records of the old format into a store being
migrated (harmless only for a step that rewrites no record, as meta's and mgmtd's 1 -> 2). Servers
of this release may run it together (each page is one transaction; see :mod:`fs3.kv.formats`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

from fs3.common.config import load_config
from fs3.common.errors import FS3Error, InvalidArgument, IoError
from fs3.kv.formats import FormatReport

__all__ = ["SERVICES", "add_upgrade_command", "guess_service", "upgrade_command", "upgrade_service"]

SERVICES = ("mgmtd", "storage", "meta")


def add_upgrade_command(admin_sub: Any) -> None:
    """``fs3 admin upgrade`` under ``fs3 admin``'s subcommands."""
    upgrade = admin_sub.add_parser("upgrade", help="migrate a stopped service's stores to this release's formats "
                                                   "(--check: report only)")
    upgrade.add_argument("--config", dest="upgrade_config", required=True,
                         help="the service's config file (what fs3 mgmtd|storage|meta --config reads)")
    upgrade.add_argument("--service", dest="upgrade_service", choices=SERVICES,
                         help="the service the config is for (default: told by its keys)")
    upgrade.add_argument("--check", action="store_true",
                         help="report store formats and pending migrations; change nothing")


def guess_service(data: dict[str, Any], path: str) -> str:
    """The service a config is for: the one whose config reads every key of it (unknown keys are
    an error to each service). A config that several could read (meta's ``node_id`` has a
    default, so ``data_dir`` alone is a meta's or a mgmtd's) needs ``--service``: opening meta's
    store as mgmtd's would stamp a mgmtd format record in it."""
    from fs3.meta.server import MetaConfig
    from fs3.mgmtd.service import MgmtdConfig
    from fs3.storage.server import StorageConfig

    readable = {"storage": {f.name for f in dataclasses.fields(StorageConfig)},
                "meta": {f.name for f in dataclasses.fields(MetaConfig)} | set(MetaConfig.MOVED_KEYS),
                "mgmtd": {f.name for f in dataclasses.fields(MgmtdConfig)}}
    fits = [service for service in SERVICES if set(data) <= readable[service]]
    if len(fits) == 1:
        return fits[0]
    which = " or ".join(fits) if fits else "none of " + ", ".join(SERVICES)
    raise InvalidArgument(f"{path}: cannot tell which service this config is for (it reads as {which}); "
                          "give --service")


def _open_rocks(path: Path, check: bool) -> Any:
    """The RocksDB store at ``path``, which must exist: an upgrade never creates one (a typo in
    the config or a disk not mounted would otherwise get an empty store, stamped current)."""
    from fs3.kv.store import RocksKVStore

    if not (path / "CURRENT").is_file():
        raise InvalidArgument(f"no RocksDB store at {path}: nothing to upgrade there (is the disk mounted, is the "
                              "config the service's?); nothing was created")
    if check:
        return RocksKVStore.open_view(path)  # read-only: opening changes no file
    try:
        return RocksKVStore(path)
    except FS3Error as exc:  # RocksKVStore's IoError: a lock held by the running service, most often
        raise IoError(f"{exc.message}; is the service still running? stop it first (or give --check, "
                      "which reads beside it)") from None
    except Exception as exc:  # rocksdict raises a bare Exception (a held lock among them)
        raise InvalidArgument(f"cannot open the RocksDB store at {path} ({exc}); is the service still "
                              "running? stop it first") from None


async def upgrade_service(service: str, config_path: str, check: bool) -> list[FormatReport]:
    """Open every store of ``service`` (its config at ``config_path``) by its format: migrate it,
    or with ``check`` only report. Returns one report per store."""
    if service == "storage":
        from fs3.storage.formats import open_target_format
        from fs3.storage.server import StorageConfig

        storage = load_config(StorageConfig, config_path, env_prefix="FS3_STORAGE")
        if storage.kv_engine != "rocksdb":
            raise InvalidArgument(f"kv_engine {storage.kv_engine!r} keeps nothing on disk: nothing to upgrade")
        reports = []
        for target in storage.targets:
            kv = _open_rocks(Path(target.path) / "meta", check)
            try:
                reports.append(open_target_format(kv, f"storage target {target.path}", check=check))
            finally:
                kv.close()
        return reports
    if service == "mgmtd":
        from fs3.mgmtd.formats import open_mgmtd_format, open_shared_mgmtd_format
        from fs3.mgmtd.server import open_shared_engine
        from fs3.mgmtd.service import MgmtdConfig

        mgmtd = load_config(MgmtdConfig, config_path, env_prefix="FS3_MGMTD")
        if mgmtd.kv_engine == "postgres":
            engine, close = await open_shared_engine(mgmtd)
            try:
                return [await open_shared_mgmtd_format(engine, f"mgmtd store (PostgreSQL, cluster {mgmtd.cluster_id})",
                                                       check=check, cluster_id=mgmtd.cluster_id)]
            finally:
                await close()
        if mgmtd.kv_engine != "rocksdb":
            raise InvalidArgument(f"kv_engine {mgmtd.kv_engine!r} keeps nothing on disk: nothing to upgrade")
        kv = _open_rocks(Path(mgmtd.data_dir) / "kv", check)
        try:
            return [open_mgmtd_format(kv, f"mgmtd store {Path(mgmtd.data_dir) / 'kv'}", check=check,
                                      cluster_id=mgmtd.cluster_id)]
        finally:
            kv.close()
    if service == "meta":
        from fs3.kv.txn import OptimisticTxnEngine
        from fs3.meta.formats import open_meta_format
        from fs3.meta.server import MetaConfig, meta_store_name

        meta = load_config(MetaConfig, config_path, env_prefix="FS3_META")
        where = meta_store_name(meta)
        if meta.kv_engine == "postgres":
            from fs3.kv.postgres import PostgresTxnEngine

            pg = await PostgresTxnEngine.open(meta.postgres_config())
            try:
                return [await open_meta_format(pg, where, check=check, cluster_id=meta.cluster_id)]
            finally:
                await pg.close()
        if meta.kv_engine != "rocksdb":
            raise InvalidArgument(f"kv_engine {meta.kv_engine!r} keeps nothing on disk: nothing to upgrade")
        kv = _open_rocks(Path(meta.data_dir) / "kv", check)
        try:
            return [await open_meta_format(OptimisticTxnEngine(kv), where, check=check, cluster_id=meta.cluster_id)]
        finally:
            kv.close()
    raise InvalidArgument(f"unknown service {service!r}: expected one of {', '.join(SERVICES)}")


def upgrade_command(args: argparse.Namespace) -> int:
    """``fs3 admin upgrade``: its exit status (0: every store current, or would be after --check)."""
    path = args.upgrade_config
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"{path}: cannot read the config ({exc})") from None
    service = args.upgrade_service or guess_service(data, path)
    reports = asyncio.run(upgrade_service(service, path, args.check))
    if getattr(args, "json", False):
        print(json.dumps([{"store": r.where, "kind": r.kind, "format": r.found, "current": r.current,
                           "pending": list(r.pending), "upgraded": r.migrated} for r in reports], indent=2))
    else:
        for report in reports:
            print(report.line())
    return 0
