"""``python -m cluster_model report [--out DIR] [--measured FILE]``, ``python -m cluster_model whatif --config FILE``
and ``python -m cluster_model measured --from RESULT [--from RESULT ...]`` (writes the measured input from named
benchmark runs: one fs3 write rate, this machine's HFReduce result, HaiScale DDP results)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster_model.cluster import load_cluster
from cluster_model.config import ConfigError
from cluster_model.measured import DEFAULT_MEASURED, load_measured, measured_from_results, write_measured
from cluster_model.report import _fmt, summary, write_report

_ROOT = Path(__file__).resolve().parents[1]


def _source_name(result: Path) -> str:
    """A result's path as the input records it: relative to the repository when it lies inside it."""
    try:
        return str(result.resolve().relative_to(_ROOT))
    except ValueError:
        return str(result)


def _whatif(config: Path, out: Path | None) -> str:
    baseline = load_cluster()
    design = load_cluster(config)
    base, new = summary(baseline), summary(design)
    lines = [f"# What if: {design.name} ({config.name}) against {baseline.name}", "",
             f"Compute node: {design.node.name}; network: {design.network.name} "
             f"({design.network.planes} plane(s), {design.network.zones} zone(s)).", "",
             "| quantity | " + baseline.name + " | " + design.name + " | ratio |", "|---|---|---|---|"]
    for key in base:
        left = base[key]
        right = new.get(key)
        if right is None:  # the job size differs between designs: the key names it
            continue
        ratio = f"{right / left:.2f}" if left else "-"
        lines.append(f"| {key} | {_fmt(left)} | {_fmt(right)} | {ratio} |")
    extra = [k for k in new if k not in base]
    for key in extra:
        lines.append(f"| {key} | - | {_fmt(new[key])} | - |")
    for note in design.network.notes:
        lines.append(f"\n- {note}")
    text = "\n".join(lines) + "\n"
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "whatif.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster_model", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="the model against the paper: Markdown and PNG plots")
    report.add_argument("--out", type=Path, default=Path("cluster_model_report"))
    report.add_argument("--measured", type=Path, default=DEFAULT_MEASURED,
                        help="what was measured here (a measured-v2.json input; default: the packaged one)")
    whatif = sub.add_parser("whatif", help="evaluate another design from a TOML file")
    whatif.add_argument("--config", type=Path, required=True)
    whatif.add_argument("--out", type=Path, default=None)
    measured = sub.add_parser("measured", help="write the measured input from named benchmark results")
    measured.add_argument("--from", dest="result", type=Path, action="append", required=True,
                          help="a benchmark result (bench/results/<kind>-<time>.json): one holding fs3 write rates, "
                               "and optionally bench/results/hfreduce.json and haiscale-ddp-<time>.json (repeat)")
    measured.add_argument("--out", type=Path, default=DEFAULT_MEASURED)
    args = parser.parse_args(argv)
    try:
        if args.command == "report":
            path = write_report(load_cluster(), args.out, load_measured(args.measured))
            print(f"wrote {path}")
        elif args.command == "measured":
            got = measured_from_results(args.result, [_source_name(r) for r in args.result])
            path = write_measured(got, args.out)
            print(f"wrote {path}: {got.write_gbs_per_node:.3f} GB/s ({got.metric} in {got.source}); "
                  f"{len(got.allreduce)} allreduce and {len(got.ddp)} DDP cells")
        else:
            print(_whatif(args.config, args.out), end="")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
