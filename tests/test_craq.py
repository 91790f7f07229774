"""The CRAQ update machine (``fs3/storage/craq.py``) driven by text scripts (``tests/craq/*.txt``).

Each script sets the facts a target sees, starts one update and feeds it events; after every
command that makes the machine act, a line starting with ``=>`` lists the effects it returned::

    chunk committed=3 length=4096       # this target's copy of the chunk
    path successor=2 routing=7          # the chain as this target sees it
    client write offset=0 length=100 new=10
    => stage v10 on v3 (whole)
    staged
    => forward v10 on v3 to 2 (update)

Commands: ``chunk committed= pending= length=``; ``path writable= head= lease= successor=
syncing= routing=`` (yes/no for flags); ``time MS``; ``pipeline yes|no`` (updates started from
here on stage and forward at once); starts — ``client KIND [offset=] [length=] new=N``,
``forward KIND version= base= [offset=] [length=]``, ``copy version= [base=] [remove]`` (a full
copy forwarded), ``sync version= [remove]``, ``repair``; events — ``staged``, ``forwarded
ok|retry|refused|diverged``, ``both STAGE FORWARD`` (a pipelined stage and forward ended: STAGE
``ok|nospace|ioerror``, FORWARD as for ``forwarded``), ``stagefail nospace|ioerror``, ``routing``,
``committed``. Run with ``FS3_REWRITE=1`` to regenerate every ``=>`` line from the code, then
review the diff.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fs3.common.errors import FS3Error, IoError, NoSpace, StaleUpdate, Unavailable
from fs3.storage.craq import (
    Abort,
    AwaitRouting,
    ChunkFacts,
    Commit,
    CompletePending,
    Effect,
    Fail,
    Forward,
    Install,
    Kind,
    Outcome,
    PathFacts,
    Reply,
    Source,
    Stage,
    StageAndForward,
    UpdateMachine,
    UpdateRequest,
)
from tests.scenario_files import check_scenario_file

SCRIPTS = sorted((Path(__file__).parent / "craq").glob("*.txt"))
_OUTCOMES = {
    "ok": (Outcome.OK, None),
    "retry": (Outcome.RETRY, Unavailable("successor unreachable")),
    "refused": (Outcome.REFUSED, NoSpace("successor's disk is full")),
    "diverged": (Outcome.DIVERGED, StaleUpdate("successor holds another version")),
}
_STAGE_ERRORS: dict[str, FS3Error | None] = {
    "ok": None, "nospace": NoSpace("this target's disk is full"), "ioerror": IoError("this target's disk failed"),
}


def _render(effect: Effect) -> str:
    if isinstance(effect, CompletePending):
        return f"complete pending v{effect.version} first"
    if isinstance(effect, Stage):
        return f"stage v{effect.version} on v{effect.base} ({effect.how})"
    if isinstance(effect, StageAndForward):
        return f"{_render(effect.stage)} + {_render(effect.forward)}"
    if isinstance(effect, Install):
        return f"install v{effect.version}"
    if isinstance(effect, Forward):
        return f"forward v{effect.version} on v{effect.base} to {effect.successor} " \
               f"({'full copy' if effect.full else 'update'})"
    if isinstance(effect, AwaitRouting):
        return f"await routing newer than {effect.routing_version}"
    if isinstance(effect, Commit):
        return f"commit v{effect.version}"
    if isinstance(effect, Abort):
        return f"abort v{effect.version}"
    if isinstance(effect, Reply):
        return "reply"
    assert isinstance(effect, Fail)
    return f"fail {effect.error.code.name}" + (" (pending kept)" if effect.pending_kept else "") \
        + (" (behind)" if effect.behind else "")


def _args(words: list[str]) -> tuple[dict[str, str], set[str]]:
    values = dict(w.split("=", 1) for w in words if "=" in w)
    return values, {w for w in words if "=" not in w}


def _flag(value: str) -> bool:
    if value not in ("yes", "no"):
        raise ValueError(f"expected yes or no, got {value!r}")
    return value == "yes"


def run_script(text: str) -> str:
    """Execute a script; returns it with every '=>' line recomputed."""
    chunk = ChunkFacts()
    path = PathFacts()
    now_ms = 0
    pipeline = False
    machine: UpdateMachine | None = None
    out: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("=>"):
            continue
        out.append(raw)
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        command, *words = line.split()
        values, flags = _args(words)
        effects: list[Effect] | None = None
        if command == "chunk":
            chunk = ChunkFacts(int(values.get("committed", 0)), int(values.get("pending", 0)),
                               int(values.get("length", 0)))
        elif command == "path":
            path = PathFacts(writable=_flag(values.get("writable", "yes")), head=_flag(values.get("head", "yes")),
                             lease_valid=_flag(values.get("lease", "yes")),
                             successor=int(values.get("successor", 0)),
                             successor_syncing=_flag(values.get("syncing", "no")),
                             routing_version=int(values.get("routing", 0)))
        elif command == "time":
            now_ms = int(words[0])
        elif command == "pipeline":
            pipeline = _flag(words[0])
        elif command in ("client", "forward", "copy", "sync", "repair"):
            kind = {"client": None, "forward": None, "copy": Kind.REPLACE, "sync": Kind.REPLACE,
                    "repair": Kind.REPLACE}[command] or Kind(words[0])
            source = {"client": Source.CLIENT, "forward": Source.FORWARD, "copy": Source.FORWARD,
                      "sync": Source.SYNC, "repair": Source.REPAIR}[command]
            request = UpdateRequest(source, kind, int(values.get("offset", 0)), int(values.get("length", 0)),
                                    int(values.get("version", 0)), int(values.get("base", 0)), "remove" in flags)
            machine = UpdateMachine(request, patch_max_bytes=256 * 1024, retry_total_ms=30_000, pipeline=pipeline)
            counter = iter(range(int(values.get("new", 0)), 1 << 62))
            effects = machine.start(chunk, path, now_ms, counter.__next__)
        elif command in ("staged", "stagefail", "forwarded", "both", "routing", "committed"):
            if machine is None:
                raise ValueError(f"line {number}: {command} before an update started")
            if command == "staged":
                effects = machine.staged(path)
            elif command == "forwarded":
                outcome, error = _OUTCOMES[words[0]]
                effects = machine.forwarded(outcome, error, path, now_ms)
            elif command == "stagefail":
                stage_error = _STAGE_ERRORS[words[0]]
                assert stage_error is not None
                effects = machine.stage_failed(stage_error, path, now_ms)
            elif command == "both":
                outcome, error = _OUTCOMES[words[1]]
                effects = machine.staged_and_forwarded(_STAGE_ERRORS[words[0]], outcome, error, path, now_ms)
            elif command == "routing":
                effects = machine.routing_changed(path, now_ms)
            else:
                effects = machine.committed()
        else:
            raise ValueError(f"line {number}: unknown command {command!r}")
        if effects is not None:
            out.append("=> " + "; ".join(_render(e) for e in effects))
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_script(path: Path) -> None:
    check_scenario_file(path, run_script)


def test_there_are_scripts() -> None:
    assert len(SCRIPTS) >= 5


def test_a_wrong_expectation_is_noticed() -> None:
    """The runner recomputes every '=>' line: a script that claims a wrong effect fails."""
    script = "chunk committed=3 length=10\npath successor=2\nclient write length=4 new=9\n=> reply\n"
    assert run_script(script) != script
