"""The command-line reference (docs/reference/cli.md), made from the parsers the commands parse with,
so that it cannot drift from them: tests/test_docs.py makes it again and compares, and fails on an
option without a help text.

    python -m launcher.cli.reference > docs/reference/cli.md
"""

from __future__ import annotations

import argparse
import sys

from ..core.launch_args import build_parser as build_launch_parser
from .commands import COMMANDS

HEADER = """# Command-line reference

Made from megaray's own argument parsers (`python -m launcher.cli.reference > docs/reference/cli.md`);
the test suite makes it again and fails where this page and the parsers differ. Every command also
prints its part with `--help`.

With no command, `megaray` (or `python main.py`) launches: a script and its arguments as torchrun
takes them, `-m module`, `--entrypoint pkg.module:function`, `--recipe NAME` or `--dry-run`.
"""


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """The options of `parser` that have no help text."""
    return [_names(a) for a in options(parser) if not (a.help or "").strip()]


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's options and positionals, less -h: argparse keeps them in `_actions` and has no
    public way to list them (its own help formatter reads the same list)."""
    skipped = argparse._HelpAction | argparse._SubParsersAction  # -h; the commands, each its own
    return [a for a in parser._actions if not isinstance(a, skipped) and a.help != argparse.SUPPRESS]


def _names(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.metavar if isinstance(action.metavar, str) else action.dest
    return ", ".join(action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.option_strings and action.nargs == 0:  # a flag: off unless given
        return ""
    if action.default in (None, argparse.SUPPRESS) or action.default == []:
        return ""
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def section(title: str, parser: argparse.ArgumentParser, summary: str = "") -> str:
    """One command: what it does, its usage line and a table of its options."""
    usage = " ".join(parser.format_usage().removeprefix("usage: ").split())
    what = _cell(parser.description or summary)
    what = what[:1].upper() + what[1:] + ("" if what.endswith((".", "?")) else ".")
    lines = [f"## `{title}`", "", what, ""]
    lines += ["```text", usage, "```", ""]
    lines += ["| option | default | what it does |", "|---|---|---|"]
    for action in options(parser):
        names = ", ".join(f"`{n}`" for n in _names(action).split(", "))
        helped = action.help or ""
        if "%(" in helped:
            helped = helped % {**vars(action), "prog": parser.prog}
        if action.option_strings and isinstance(action.choices, list | tuple):
            helped += f" (one of {', '.join(str(c) for c in action.choices)})"
        lines.append(f"| {names} | {_default(action)} | {_cell(helped)} |")
    return "\n".join(lines) + "\n"


def parsers() -> list[tuple[str, argparse.ArgumentParser, str]]:
    """Every command's parser, the launch's first, in the order `megaray --help` lists them, each
    with its one-line summary."""
    launch = ("megaray", build_launch_parser(), "")
    return [launch, *((f"megaray {c.name}", c.parser(c.name), c.summary) for c in COMMANDS.values())]


def markdown() -> str:
    return "\n".join([HEADER, *(section(*command) for command in parsers())])


if __name__ == "__main__":
    sys.stdout.write(markdown())
