"""Argument types shared by the subcommands: a bad count is refused by argparse, naming the flag."""

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
