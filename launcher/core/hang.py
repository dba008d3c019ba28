"""Hangs as failures: what each rank's state and stack, read on its node, say about who is stuck.

No rank printed or reported progress for `--hang-timeout` seconds; the job then fails like any other
rank failure (and is relaunched when restarts are left), with the stacks in the output.
"""

from __future__ import annotations

import time
from typing import Any

from .errors import FailureKind, RankFailure

_STATES = {
    "R": "running",
    "S": "sleeping (waiting)",
    "D": "in uninterruptible I/O",
    "T": "stopped (SIGSTOP)",
    "t": "stopped by a debugger",
    "Z": "a zombie",
}


def top_frame(stack: str | None) -> str:
    """The innermost frame of the main thread in a py-spy dump (its first frame line)."""
    if not stack:
        return ""
    for line in stack.splitlines():
        s = line.strip()
        if s and not s.startswith(("Process ", "Python v", "Thread ")):
            return s
    return ""


def _frames(stack: str) -> tuple[str, ...]:
    """A stack's frames, without what differs between identical ranks (the pid, the thread ids)."""
    return tuple(
        s
        for ln in stack.splitlines()
        if (s := ln.strip()) and not s.startswith(("Process ", "Python v", "Thread "))
    )


def group_stacks(seen: dict[int, dict[str, Any]]) -> list[tuple[list[int], dict[str, Any]]]:
    """Ranks whose stacks read the same frames, together, each group with its first rank's reading;
    in rank order. At thousands of ranks most wait in the same collective: one stack, not thousands."""
    groups: dict[tuple[str, ...], tuple[list[int], dict[str, Any]]] = {}
    for rank in sorted(seen):
        info = seen[rank]
        if info.get("stack"):
            groups.setdefault(_frames(info["stack"]), ([], info))[0].append(rank)
    return list(groups.values())


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
                kind=FailureKind.HUNG if stuck else FailureKind.WAITING, summary=summary,
                traceback=info.get("stack") or "", at=now,
            )
        )  # fmt: skip
    return failures
