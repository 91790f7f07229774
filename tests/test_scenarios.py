"""Chain state scenarios written as text (``tests/scenarios/*.txt``), in the spirit of raft's testdata.

Each file is a script::

    chain 1 2 3          # a chain of targets 1, 2, 3: all serving and up to date, version 1
    local 1 offline      # target 1's node reports (or is taken as) offline
    scan                 # mgmtd scans the chain; the result follows on a line starting with "=>"
    => 2:serving 3:serving 1:offline v2

Run with ``FS3_REWRITE=1`` to regenerate every "=>" line from the code, then review the diff.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fs3.common.target_state import LocalState, PublicState
from fs3.mgmtd.chain_state import update_chain
from tests.scenario_files import check_scenario_file

SCENARIOS = sorted((Path(__file__).parent / "scenarios").glob("*.txt"))
_LOCAL = {"up-to-date": LocalState.UP_TO_DATE, "online": LocalState.ONLINE, "offline": LocalState.OFFLINE}


def run_script(text: str) -> str:
    """Execute a scenario; returns the script with every '=>' line recomputed."""
    order: list[int] = []
    states: dict[int, PublicState] = {}
    local: dict[int, LocalState] = {}
    version = 1
    out: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if raw.startswith("=>"):
            continue  # expectations are regenerated below
        out.append(raw)
        if not line:
            continue
        words = line.split()
        if words[0] == "chain":
            order = [int(w) for w in words[1:]]
            states = dict.fromkeys(order, PublicState.SERVING)
            local = dict.fromkeys(order, LocalState.UP_TO_DATE)
            version = 1
        elif words[0] == "local":
            local[int(words[1])] = _LOCAL[words[2]]
        elif words[0] == "scan":
            result = update_chain(order, states, local, version)
            order, states, version = list(result.target_ids), dict(result.states), result.chain_version
            out.append("=> " + " ".join(f"{t}:{states[t].name.lower()}" for t in order) + f" v{version}")
        else:
            raise ValueError(f"line {number}: unknown command {words[0]!r}")
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_scenario(path: Path) -> None:
    check_scenario_file(path, run_script)


def test_there_are_scenarios() -> None:
    assert len(SCENARIOS) >= 4
