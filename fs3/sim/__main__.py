"""``python -m fs3.sim --seeds N`` / ``--seed S``: run simulation seeds and report failures.

Seeds run in parallel (``--jobs``, every core by default) and each result is appended to
``bench/results/sim/<config>.jsonl`` as it finishes, so ``--resume`` picks an interrupted sweep up
where it stopped (see :mod:`fs3.sim.sweep`). ``--seed S`` replays one seed in this process, verbose
with virtual timestamps.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from fs3.sim.run import MIXES, run_seed
from fs3.sim.sweep import RESULTS_DIR, SweepBusy, SweepConfig, print_outcome, sweep


def _virtual_time(record: logging.LogRecord) -> bool:
    try:
        record.vt = asyncio.get_running_loop().time()
    except RuntimeError:
        record.vt = 0.0
    return True


def _replay(seed: int, args: argparse.Namespace) -> int:
    """One seed in this process, with its log: what a failing seed's replay command runs."""
    result = run_seed(seed, clients=args.clients, ops_per_client=args.ops, fault_intensity=args.faults,
                      mix=args.mix)
    print(result.summary())
    for violation in result.violations[:20]:
        print("   ", violation)
    for fault in result.faults if not result.ok else []:
        print("    fault:", fault)
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fs3.sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=100, help="run seeds first..first+N-1")
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--seed", type=int, help="replay one seed (verbose)")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--ops", type=int, default=60, help="operations per client")
    parser.add_argument("--faults", type=float, default=1.0, help="fault intensity (0 disables faults)")
    parser.add_argument("--mix", default="default", choices=MIXES,
                        help="operation, shape and fault mix (legacy: the first simulator's, to replay old seeds; "
                             "meta: the metadata service and several namespace clients)")
    parser.add_argument("--jobs", "-j", type=int, default=None, help="processes (default: every core)")
    parser.add_argument("--resume", action="store_true",
                        help="skip seeds already recorded for this configuration (make sim does)")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where results are kept")
    parser.add_argument("--no-record", dest="record", action="store_false",
                        help="keep no results (and so cannot resume)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.seeds < 0 or (args.jobs is not None and args.jobs < 1):
        parser.error("--seeds must be >= 0 and --jobs >= 1")
    logging.basicConfig(level=logging.INFO if (args.verbose or args.seed is not None) else logging.CRITICAL,
                        format="%(vt)9.4f %(levelname).1s %(name)s: %(message)s")
    logging.getLogger().handlers[0].addFilter(_virtual_time)
    if args.seed is not None:
        return _replay(args.seed, args)
    config = SweepConfig(clients=args.clients, ops=args.ops, faults=args.faults, mix=args.mix)
    seeds = list(range(args.first, args.first + args.seeds))
    try:
        outcome = sweep(config, seeds, jobs=args.jobs, resume=args.resume, results_dir=args.results,
                        record=args.record)
    except SweepBusy as exc:
        print(f"python -m fs3.sim: {exc}", file=sys.stderr)
        return 2
    print_outcome(outcome)
    if outcome.interrupted:
        return 130
    return 1 if outcome.failing else 0


if __name__ == "__main__":
    sys.exit(main())
