"""Run megaray as a user runs it: `python main.py ARGS` in a fresh process, from a working folder,
with the environment the test gives. Every test that runs the driver goes through here, so that what
"as a user runs it" means (the interpreter, the entry point, the streams) is said once.

A test names its cluster (`--address`, or the environment it passes): this process's RAY_ADDRESS is
never handed down, and neither is its Ray token mode unless the test asks for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from .conftest import REPO


def _main(cwd: Path | str) -> str:
    """`main.py` as the README runs it from the checkout; its full path from anywhere else."""
    return "main.py" if Path(cwd).resolve() == REPO else str(REPO / "main.py")


def user_env(
    base: Mapping[str, str] | None = None, *, drop: tuple[str, ...] = (), **more: str
) -> dict[str, str]:
    """`base` (this process's environment by default) without RAY_ADDRESS and the names starting with
    any of `drop`, with `more` set."""
    base = os.environ if base is None else base
    return {
        **{k: v for k, v in base.items() if k != "RAY_ADDRESS" and not (drop and k.startswith(drop))},
        **more,
    }


def start(
    *args: str, env: Mapping[str, str] | None = None, cwd: Path | str = REPO, log: Path | None = None
) -> subprocess.Popen:
    """The driver, running: its stdout and stderr together, as a terminal shows them, in a text pipe
    (`proc.stdout`) or in the file `log`; no standard input (as under CI, and as `run` gives it)."""
    out = log.open("w") if log is not None else subprocess.PIPE
    try:
        return subprocess.Popen(
            [sys.executable, _main(cwd), *args],
            cwd=cwd,
            env=user_env() if env is None else dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
    finally:
        if log is not None:
            out.close()  # the child has its own descriptor


def run(
    *args: str, env: Mapping[str, str] | None = None, cwd: Path | str = REPO, timeout: float = 300
) -> subprocess.CompletedProcess:
    """The driver, to its end: stdout and stderr apart (text), no standard input (as under CI)."""
    return subprocess.run(
        [sys.executable, _main(cwd), *args],
        cwd=cwd,
        env=user_env() if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
