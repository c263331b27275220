"""Argument types shared by the subcommands (a bad count is refused by argparse, naming the flag), and
the open-ended `--section.key=value` config overrides."""

import argparse


def _integer(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of prompts, samples, tokens, layers)."""
    return _integer(text, 1, "at least 1")


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (steps that may be skipped, a top-k where 0 means off)."""
    return _integer(text, 0, "at least 0")


def is_override(arg: str) -> bool:
    return arg.startswith("--") and "=" in arg


def collect_overrides(p: argparse.ArgumentParser) -> None:
    """Let `p` take any `--section.key=value` (config overrides, open-ended, so argparse cannot list
    them) into `args.overrides`; other unknown arguments stay errors."""
    p.set_defaults(overrides=[])
    parse_known = p.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, rest = parse_known(args, namespace)
        ns.overrides = list(ns.overrides) + [a for a in rest if is_override(a)]
        return ns, [a for a in rest if not is_override(a)]

    p.parse_known_args = parse_known_args
