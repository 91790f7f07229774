"""How commands print: tables and sizes for people, JSON for programs, progress on a terminal.

One module so that every command spells a state the same way (``serving``, ``up_to_date``,
``offline``) in its table and in its ``--json``, prints 64-bit counters as JSON numbers (protobuf's
own JSON mapping makes them strings), and shows progress only where a person watches: on a
terminal's stderr, never in a pipe and never inside ``--json`` output.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

__all__ = ["human_bytes", "message_dict", "print_json", "progress", "state_name", "table"]

# Prefixes an enum value's name carries only to be unique in its proto package.
_PREFIXES = ("local_", "node_")


def state_name(enum_type: Any, value: int) -> str:
    """An enum value as every command spells it: lower case, without its package prefix
    (``LOCAL_OFFLINE`` -> ``offline``, ``NODE_STORAGE`` -> ``storage``); ``none`` for unset."""
    if value == 0:
        return "none"  # e.g. the public state of a target that is in no chain yet
    try:
        name = str(enum_type.Name(value)).lower()
    except ValueError:
        return str(value)
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    return name


def _value(field: Any, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return state_name(_Enum(field), value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return bytes(value).hex()
    return value


class _Enum:
    """``Name(number)`` of an enum descriptor, the shape :func:`state_name` reads."""

    def __init__(self, field: Any) -> None:
        self._values = field.enum_type.values_by_number

    def Name(self, number: int) -> str:
        if number not in self._values:
            raise ValueError(number)
        return str(self._values[number].name)


def _repeated(field: Any) -> bool:
    """Whether a field is a list (``label`` is gone from protobuf 6's descriptors, ``is_repeated``
    new in them)."""
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def message_dict(message: Message) -> dict[str, Any]:
    """``message`` as JSON-ready data: every field (unset ones at their defaults, so a key is
    always there), integers as numbers, enums as :func:`state_name` spells them, bytes as hex."""
    out: dict[str, Any] = {}
    fields: list[Any] = list(message.DESCRIPTOR.fields)
    for field in fields:
        value = getattr(message, field.name)
        if _repeated(field):
            out[field.name] = [_value(field, v) for v in value]
        else:
            out[field.name] = _value(field, value)
    return out


def print_json(data: Any) -> None:
    """``data`` (messages inside it converted) as indented JSON on stdout."""
    def default(obj: object) -> object:
        if isinstance(obj, Message):
            return message_dict(obj)
        raise TypeError(f"not JSON: {type(obj).__name__}")

    print(json.dumps(data, indent=2, default=default))


def table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} PiB"


@contextlib.contextmanager
def progress(description: str, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr while the block runs, when stderr is a terminal (and ``enabled``:
    never for ``--json``); yields ``update(done, total)``. Elsewhere the update does nothing, so
    logs and pipes get no control characters."""
    if not enabled or not sys.stderr.isatty():
        yield lambda done, total: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)

        yield update
