"""Argument types shared by the subcommands (a bad count is refused by argparse, naming the flag), and
the open-ended config overrides, `--section.key=value` or `--section.key value`."""

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


def _is_dotted_key(arg: str) -> bool:
    """`--section.key` without a value (the value follows as the next argument)."""
    return arg.startswith("--") and "=" not in arg and "." in arg.strip("-.")


def join_overrides(rest: list[str]) -> tuple[list[str], list[str]]:
    """(overrides as `--key=value`, the other arguments): `--a.b value` pairs are joined into one."""
    overrides, other, i = [], [], 0
    while i < len(rest):
        arg = rest[i]
        if is_override(arg):
            overrides.append(arg)
        elif _is_dotted_key(arg) and i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            overrides.append(f"{arg}={rest[i + 1]}")
            i += 1
        else:
            other.append(arg)
        i += 1
    return overrides, other


def collect_overrides(p: argparse.ArgumentParser) -> None:
    """Let `p` take any `--section.key=value` or `--section.key value` (config overrides, open-ended,
    so argparse cannot list them) into `args.overrides`; other unknown arguments stay errors."""
    p.set_defaults(overrides=[])
    parse_known = p.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, rest = parse_known(args, namespace)
        overrides, other = join_overrides(rest)
        bare = [a for a in other if _is_dotted_key(a)]
        if bare:
            p.error(f"override {bare[0]} needs a value: {bare[0]}=VALUE or {bare[0]} VALUE")
        ns.overrides = list(ns.overrides) + overrides
        return ns, other

    p.parse_known_args = parse_known_args
