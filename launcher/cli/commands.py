"""The subcommands of `megaray`, in one registry: the dispatch (cli/main.py) and the list that
`megaray --help` shows (as `git --help` and `ray --help` do) come from it, so a command cannot be
added to one and missed in the other. Each command's module is imported only when it runs: `--help`
and bad input stay fast."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    summary: str  # one line, for `megaray --help`
    # (name, the arguments after it, whether the process ends when it returns) -> exit code
    run: Callable[[str, list[str], bool], int]
    # name -> the command's argument parser, for the reference (cli/reference.py)
    parser: Callable[[str], argparse.ArgumentParser]


def _jobs(name: str, argv: list[str], exits_after: bool) -> int:
    from .jobs import main

    return main([name, *argv], exits_after)


def _up(name: str, argv: list[str], exits_after: bool) -> int:
    from .up import main

    return main(name, argv, exits_after)


def _doctor(_name: str, argv: list[str], exits_after: bool) -> int:
    from .doctor import main

    return main(argv, exits_after)


def _recipes(_name: str, argv: list[str], _exits_after: bool) -> int:
    from .recipes import main

    return main(argv)


def _jobs_parser(name: str) -> argparse.ArgumentParser:
    from .jobspec import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _up_parser(name: str) -> argparse.ArgumentParser:
    from .up import build_parser

    return build_parser(name)


def _doctor_parser(_name: str) -> argparse.ArgumentParser:
    from .doctor import build_parser

    return build_parser()


def _recipes_parser(_name: str) -> argparse.ArgumentParser:
    from .recipes import build_parser

    return build_parser()


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("up", "start a local Ray that launches attach to, with a pool of rank processes (--warm: "
                "torch imported)", _up, _up_parser),
        Command("down", "stop the local Ray of `megaray up`, leaving no process (--address: give back "
                "that cluster's warm pool)", _up, _up_parser),
        Command("list", "show `megaray up`, its pool, and the cluster's submitted jobs", _jobs, _jobs_parser),
        Command("submit", "run a launch as a Ray job on the cluster's head and stream its logs", _jobs,
                _jobs_parser),
        Command("status", "show a submitted job's status, exit code, layout and target", _jobs, _jobs_parser),
        Command("logs", "print a submitted job's logs (-f: until it ends)", _jobs, _jobs_parser),
        Command("stop", "stop a submitted job and wait until it ended", _jobs, _jobs_parser),
        Command("recipes", "list the recipes --recipe takes (ours and Megatron-Bridge's), or show one "
                "resolved", _recipes, _recipes_parser),
        Command("doctor", "check a cluster before a launch: versions, GPUs, network devices, disk, an "
                "all-reduce", _doctor, _doctor_parser),
    )
}  # fmt: skip


def commands_help() -> str:
    """The commands section of `megaray --help`."""
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {c.name:<{width}}  {c.summary}" for c in COMMANDS.values()]
    return "\n".join(
        [
            "commands (megaray COMMAND --help for each):",
            *lines,
            "",
            "With no command, megaray launches: megaray [options] script.py [args] (as torchrun),",
            "or -m module, --entrypoint pkg.module:function, --recipe NAME, --dry-run.",
        ]
    )
