"""`minite` command line: one subcommand per job; each lives in its own module."""

import argparse
import sys

from minite import __version__
from minite.commands import agreement_cmd, diagnose_cmd, experiment_cmd, quantize_cmd, train_cmd

COMMANDS = {
    "quantize": quantize_cmd,
    "agreement": agreement_cmd,
    "diagnose": diagnose_cmd,
    "train": train_cmd,
    "experiment": experiment_cmd,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minite",
        description="miniTE: RL of LLMs with native NVFP4 on sampler and learner.",
    )
    p.add_argument("--version", action="version", version=f"minite {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        module.add_parser(sub, name)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args) or 0
    except (ValueError, TypeError, FileNotFoundError, KeyError) as e:
        print(f"minite {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
