"""`minite experiment`: run an experiment file's arms x seeds side by side and write one report.

    minite experiment configs/experiments/naive_vs_aligned.toml              all arms, the file's seeds
    minite experiment FILE --parallel 6 --seeds 0 1 --arms aligned,naive --rl.steps=50
    minite experiment FILE --report-only                                    report what has run so far
"""

import argparse
import sys
from pathlib import Path

from minite.commands.args import collect_overrides

HELP = "run several training arms x seeds side by side (separate processes) and compare them in one report"


def add_parser(sub, name):
    p = sub.add_parser(name, help=HELP, description=HELP, epilog="Any --section.key=value is added to "
                       "every arm's overrides, e.g. --rl.steps=50",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="an experiment TOML (see configs/experiments/)")
    p.add_argument("--out", help="output folder (default: runs/<experiment name>)")
    p.add_argument("--parallel", type=int, default=0, help="runs at once (default: all)")
    p.add_argument("--seeds", type=int, nargs="+", help="replace the file's seeds")
    p.add_argument("--arms", help="comma-separated subset of the file's arms")
    p.add_argument("--report-only", action="store_true", help="write the report of what has run, run nothing")
    collect_overrides(p)


def run(args) -> int:
    from minite.experiment import launch, load_experiment, write_report

    if args.parallel < 0:
        raise ValueError(f"--parallel {args.parallel} must be >= 0 (0: all runs at once)")
    arms = [a for a in args.arms.split(",") if a] if args.arms else None
    exp = load_experiment(args.file, seeds=args.seeds, extra=[o.removeprefix("--") for o in args.overrides],
                          arms=arms)
    out = Path(args.out or Path("runs") / exp.name)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.report_only:
        n = len(exp.arms) * len(exp.seeds)
        parallel = args.parallel or n
        print(f"minite experiment: {n} runs ({len(exp.arms)} arms x {len(exp.seeds)} seeds), {parallel} at "
              f"once, into {out}", flush=True)
        try:
            codes = launch(exp, out, parallel)
        except KeyboardInterrupt:
            print("minite experiment: interrupted; the runs saved at their step boundary where they "
                  "checkpoint; rerun the same command to resume (report so far: --report-only)",
                  file=sys.stderr)
            return 130
        failed = [k for k, c in codes.items() if c != 0]
    report = write_report(exp, out)
    sys.stdout.write((out / "report.md").read_text())
    print(f"report: {out}/report.md, report.json, curves.png")
    if failed:
        print(f"minite experiment: error: {len(failed)} runs failed: {', '.join(failed)} "
              f"(their train.log says why; rerun to resume)", file=sys.stderr)
        return 1
    return 0 if report["arms"] else 1
