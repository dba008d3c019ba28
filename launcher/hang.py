"""Hangs: no rank printed or reported progress for `--hang-timeout` seconds.

A hung collective holds every GPU of the job until NCCL's watchdog fires (10 minutes by default)
or forever, and says little about why. When the driver sees no activity from any rank for the
timeout, a task on each rank's node reads the process state (a SIGSTOPped or swapped-out rank shows
there) and its Python stack with py-spy, which Ray's dashboard also uses; where py-spy cannot attach,
the rank's faulthandler is asked to print its stack into the rank's log. The job then fails like any
other rank failure (and is relaunched when restarts are left), with the stacks in the output.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .errors import RankFailure

_STATES = {
    "R": "running",
    "S": "sleeping (waiting)",
    "D": "in uninterruptible I/O",
    "T": "stopped (SIGSTOP)",
    "t": "stopped by a debugger",
    "Z": "a zombie",
}


def _py_spy() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def process_state(pid: int) -> str | None:
    """The state letter in /proc/<pid>/stat (R, S, T, Z, ...); None when there is no such process."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115
        return stat[stat.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return None


def inspect_process(pid: int) -> dict[str, Any]:
    """On the rank's node: state and Python stack of one rank process."""
    out: dict[str, Any] = {"pid": pid, "state": "?", "stack": None, "how": None}
    state = process_state(pid)
    if state is None:
        out["state"] = "gone"
        return out
    out["state"] = state
    spy = _py_spy()
    if spy:
        try:
            done = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20
            )
            if done.returncode == 0 and done.stdout.strip():
                out["stack"], out["how"] = done.stdout, "py-spy"
                return out
            out["spy_error"] = (done.stderr or done.stdout).strip().splitlines()[-1:]
        except (OSError, subprocess.SubprocessError) as e:
            out["spy_error"] = [str(e)]
    if out["state"] in ("T", "t"):
        out["how"] = "nobody: a stopped process cannot run its faulthandler (SIGCONT it to inspect)"
        return out
    try:  # the rank registered faulthandler on SIGUSR1: its stack goes to its log
        os.kill(pid, signal.SIGUSR1)
        out["how"] = "faulthandler (see the rank's log)"
    except OSError:
        pass
    return out


def inspect_processes(pids: list[int]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=min(8, len(pids) or 1)) as pool:
        return list(pool.map(inspect_process, pids))


def top_frame(stack: str | None) -> str:
    """The innermost frame of the main thread in a py-spy dump (its first frame line)."""
    if not stack:
        return ""
    for line in stack.splitlines():
        s = line.strip()
        if s and not s.startswith(("Process ", "Python v", "Thread ")):
            return s
    return ""


def hang_failures(
    idle_s: float, ranks: list[dict[str, Any]], seen: dict[int, dict[str, Any]]
) -> list[RankFailure]:
    """One failure per rank; stopped or dead processes first (kind "hung"), the rest "waiting"."""
    now = time.time()
    failures = []
    for r in ranks:
        info = seen.get(r["rank"], {"state": "?", "stack": None, "how": None})
        state = info["state"]
        stuck = state in ("T", "t", "Z", "D", "gone")
        what = _STATES.get(state, "gone" if state == "gone" else f"state {state}")
        frame = top_frame(info.get("stack"))
        summary = f"no output or progress from any rank for {idle_s:.0f}s; process {what}"
        if frame:
            summary += f"; at {frame}"
        elif info.get("how"):
            summary += f"; stack read by {info['how']}"
        failures.append(
            RankFailure(
                rank=r["rank"], node_ip=r["node_ip"], hostname=r["hostname"], gpu=r["gpu"],
                kind="hung" if stuck else "waiting", summary=summary, traceback=info.get("stack") or "",
                at=now,
            )
        )  # fmt: skip
    return failures
