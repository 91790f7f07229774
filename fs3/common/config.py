"""TOML configuration with environment overrides.

Each service describes its settings as a dataclass with defaults (the embedded defaults that
make ``fs3 local up`` work without a file). :func:`load_config` reads an optional TOML file,
then applies environment overrides named ``<PREFIX>_<FIELD>`` (e.g. ``FS3_STORAGE_NODE_ID=3``),
converting and validating every value. Unknown keys are an error, not silently ignored: a typo
in a config file must not fall back to a default.

A component's settings are a nested table of the process's (``[service]`` in meta's file,
``[replica]`` in storage's), declared as a dataclass-typed field, so every knob of the component is
settable and none is copied by hand. Environment overrides reach into it as
``<PREFIX>_<TABLE>_<FIELD>`` (``FS3_META_SERVICE_ROOT_MODE=511``). A key that moved into a table
(listed in the class's ``MOVED_KEYS``) is still accepted at the top level, with a warning naming its
new place; given in both places, the table wins.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from fs3.common.errors import InvalidArgument

__all__ = ["config_from_mapping", "load_config"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def _convert(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (types.UnionType, typing.Union):
        non_none = [a for a in args if a is not type(None)]
        if value is None:
            return None
        return _convert(value, non_none[0], where)
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        if not isinstance(value, Mapping):
            raise InvalidArgument(f"{where}: expected a table, got {type(value).__name__}")
        return config_from_mapping(annotation, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise InvalidArgument(f"{where}: expected a list, got {type(value).__name__}")
        return [_convert(item, args[0], f"{where}[{i}]") for i, item in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise InvalidArgument(f"{where}: expected a boolean, got {_shown(where, value)}")
    if annotation is int:
        if isinstance(value, bool):
            raise InvalidArgument(f"{where}: expected an integer, got {_shown(where, value)}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise InvalidArgument(f"{where}: expected an integer, got {_shown(where, value)}") from None
    if annotation is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise InvalidArgument(f"{where}: expected a number, got {_shown(where, value)}") from None
    if annotation is str:
        if not isinstance(value, str | int | float):
            raise InvalidArgument(f"{where}: expected a string, got {_shown(where, value)}")
        return str(value)
    return value


def _shown(where: str, value: Any) -> str:
    """How an error names a bad value: never the value of a setting that may hold a secret."""
    if "token" in where.lower() or "secret" in where.lower():
        return f"a {type(value).__name__}"
    return repr(value)


def _moved_keys(cls: type[Any]) -> Mapping[str, str]:
    """``cls``'s top-level keys that moved into a nested table: key -> the table's field name."""
    moved: Mapping[str, str] = getattr(cls, "MOVED_KEYS", {})
    return moved


def _nest_moved(cls: type[Any], data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``data`` with each moved top-level key put into its table (a warning says where it belongs)."""
    out = dict(data)
    for key, table in _moved_keys(cls).items():
        if key not in out:
            continue
        value = out.pop(key)
        log.warning("%s: key %r is deprecated at the top level; set it in the [%s] table (%s.%s)",
                    where, key, table, table, key)
        nested = out.get(table, {})
        if not isinstance(nested, Mapping):
            raise InvalidArgument(f"{where}.{table}: expected a table, got {type(nested).__name__}")
        out[table] = {key: value, **nested}
    return out


def config_from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "config") -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and ill-typed values.

    A nested table starts from the field's default (a process may default a component's knob
    differently from the component), and only the keys given replace it.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    data = _nest_moved(cls, data, where)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise InvalidArgument(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    kwargs = {}
    for key, value in data.items():
        annotation = hints[key]
        default_factory = fields[key].default_factory
        if dataclasses.is_dataclass(annotation) and isinstance(annotation, type) and isinstance(value, Mapping) \
                and default_factory is not dataclasses.MISSING:
            base = default_factory()
            table = config_from_mapping(annotation, value, f"{where}.{key}")  # validates the keys given
            kwargs[key] = dataclasses.replace(base, **{name: getattr(table, name) for name in value})
            validate_table = getattr(kwargs[key], "validate", None)
            if callable(validate_table):
                validate_table()
        else:
            kwargs[key] = _convert(value, annotation, f"{where}.{key}")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def load_config(
    cls: type[T],
    path: str | os.PathLike[str] | None = None,
    env_prefix: str = "FS3",
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Defaults < TOML file < ``overrides`` (e.g. CLI flags) < environment ``<env_prefix>_<FIELD>``."""
    data: dict[str, Any] = {}
    if path is not None:
        file_path = Path(path)
        try:
            with file_path.open("rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise InvalidArgument(f"config file {file_path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"config file {file_path}: {exc}") from None
    if overrides:
        data.update({k: v for k, v in overrides.items() if v is not None})
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    for old, table_name in _moved_keys(cls).items():
        key = f"{env_prefix}_{old.upper()}"
        if key in env:
            # Into the table itself, so that the environment still overrides the file's table.
            log.warning("environment %s is deprecated; use %s_%s_%s", key, env_prefix, table_name.upper(),
                        old.upper())
            moved = data.setdefault(table_name, {})
            if not isinstance(moved, dict):
                raise InvalidArgument(f"environment {key}: {table_name} is not a table")
            moved[old] = env[key]
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = f"{env_prefix}_{field.name.upper()}"
        annotation = hints[field.name]
        if key in env:
            if typing.get_origin(annotation) is list or dataclasses.is_dataclass(annotation):
                try:
                    data[field.name] = tomllib.loads(f"v = {env[key]}")["v"]
                except tomllib.TOMLDecodeError as exc:
                    raise InvalidArgument(f"environment {key}: not a TOML value: {exc}") from None
            else:
                data[field.name] = env[key]
        if dataclasses.is_dataclass(annotation):
            for sub in dataclasses.fields(annotation):
                sub_key = f"{key}_{sub.name.upper()}"
                if sub_key in env:
                    table = data.setdefault(field.name, {})
                    if not isinstance(table, dict):
                        raise InvalidArgument(f"environment {sub_key}: {field.name} is not a table")
                    table[sub.name] = env[sub_key]
    return config_from_mapping(cls, data, where=str(path) if path else "config")
