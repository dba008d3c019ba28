"""The command lines' argument parser: it raises instead of exiting, so `main()` owns the exit code
and prints the one-line message."""

from __future__ import annotations

import argparse

from .errors import UsageError


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")
