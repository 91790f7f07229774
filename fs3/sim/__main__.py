"""``python -m fs3.sim --seeds N`` / ``--seed S``: run simulation seeds and report failures."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from fs3.sim.run import run_seed


def _virtual_time(record: logging.LogRecord) -> bool:
    try:
        record.vt = asyncio.get_running_loop().time()
    except RuntimeError:
        record.vt = 0.0
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fs3.sim", description=__doc__)
    parser.add_argument("--seeds", type=int, default=100, help="run seeds first..first+N-1")
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--seed", type=int, help="replay one seed (verbose)")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--ops", type=int, default=60, help="operations per client")
    parser.add_argument("--faults", type=float, default=1.0, help="fault intensity (0 disables faults)")
    parser.add_argument("--mark-offline", action="store_true",
                        help="add admin mark-offline of a serving target to the fault mix (changes seeds)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if (args.verbose or args.seed is not None) else logging.CRITICAL,
                        format="%(vt)9.4f %(levelname).1s %(name)s: %(message)s")
    logging.getLogger().handlers[0].addFilter(_virtual_time)
    seeds = [args.seed] if args.seed is not None else range(args.first, args.first + args.seeds)
    failed = 0
    started = time.monotonic()
    for seed in seeds:
        result = run_seed(seed, clients=args.clients, ops_per_client=args.ops, fault_intensity=args.faults,
                          mark_offline_faults=args.mark_offline)
        if not result.ok:
            failed += 1
            print(result.summary())
            for violation in result.violations[:20]:
                print("   ", violation)
            for fault in result.faults:
                print("    fault:", fault)
            print(f"    replay: python -m fs3.sim --seed {seed} --clients {args.clients} --ops {args.ops} "
                  f"--faults {args.faults}" + (" --mark-offline" if args.mark_offline else ""))
        elif args.seed is not None or args.verbose:
            print(result.summary())
    total = len(seeds)
    print(f"{total - failed} passed, {failed} failed ({time.monotonic() - started:.1f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
