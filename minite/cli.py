"""`minite` command line: one subcommand per job; each lives in its own module.

Bad input and failing file system operations end in one line, `minite <command>: error: ...`, with
exit status 2 (no traceback); warnings raised by minite print as `minite <command>: warning: ...`.
"""

import argparse
import sys
import warnings
from pathlib import Path

from minite import __version__
from minite.commands import (
    agreement_cmd,
    diagnose_cmd,
    eval_cmd,
    experiment_cmd,
    export_cmd,
    quantize_cmd,
    train_cmd,
)
from minite.files import describe_os_error

COMMANDS = {
    "quantize": quantize_cmd,
    "agreement": agreement_cmd,
    "diagnose": diagnose_cmd,
    "train": train_cmd,
    "eval": eval_cmd,
    "experiment": experiment_cmd,
    "export": export_cmd,
}
PACKAGE_DIR = str(Path(__file__).resolve().parent)
INTERRUPTED = 130  # the shell's status for a process ended by SIGINT


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
    prefix = f"minite {args.command}"
    with warnings.catch_warnings():  # restores the warning printer on the way out
        warnings.showwarning = _one_line_warnings(prefix, warnings.showwarning)
        try:
            return COMMANDS[args.command].run(args) or 0
        except OSError as e:  # full disk, permissions, a missing file: the path and what to do
            return _error(prefix, describe_os_error(e))
        except (ValueError, TypeError, KeyError) as e:
            return _error(prefix, str(e))
        except KeyboardInterrupt:
            print(f"\n{prefix}: interrupted", file=sys.stderr)
            return INTERRUPTED


def _error(prefix: str, message: str) -> int:
    print(f"{prefix}: error: {message}", file=sys.stderr)
    return 2


def _one_line_warnings(prefix: str, default):
    """minite's own warnings as one line naming the command; anyone else's as Python prints them."""

    def show(message, category, filename, lineno, file=None, line=None):
        ours = str(filename).startswith(PACKAGE_DIR) or category.__module__.startswith("minite.")
        if not ours:
            return default(message, category, filename, lineno, file, line)
        print(f"{prefix}: warning: {message}", file=file or sys.stderr)

    return show


if __name__ == "__main__":
    sys.exit(main())
