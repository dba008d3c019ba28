"""The command lines' argument parser: it raises instead of exiting, so `main()` owns the exit code
and prints the one-line message."""

from __future__ import annotations

import argparse
import math

from .errors import UsageError


def number(text: str) -> float:
    """A float option's value: a finite number. `nan` and `inf` parse as floats, and slipped past
    every range check (`nan < 0` is false): `--kill-grace nan` crashed a teardown."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")
