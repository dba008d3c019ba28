"""Why a rank's process died, told from what is left of it: Ray's death message, the rank's last
output (Python's faulthandler, on in every Ray worker, prints the fatal signal and the stack), and
the node's OOM-killer count. Ray itself says only that the worker "exited unexpectedly"."""

from __future__ import annotations

import re


def describe_death(ray_message: str) -> str:
    """One line for a rank process that died, from Ray's ActorDiedError text.

    Ray's text lists every possible cause of an unexpected exit (OOM killer, `ray stop`, a crash);
    keep what it knows for sure: its memory monitor, a lost node, or the exit detail.
    """
    text = " ".join(ray_message.split())
    low = text.lower()
    if "low on memory" in low or "out_of_memory" in low:
        what = "killed by Ray's memory monitor: the node ran low on memory"
    elif "node has died" in low or "node died" in low or "node_died" in low or "node was lost" in low:
        what = "its node was lost"
    elif "intentionally killed" in low or "ray.kill" in low:
        what = "its actor was killed (ray.kill or `ray stop`)"
    else:
        what = "its process exited unexpectedly (a signal such as SIGKILL, the kernel OOM killer, or a crash)"
    detail = re.search(r"Worker exit detail: (.*?\.)( |$)", text)
    return f"{what}; Ray: {detail.group(1)}" if detail else what


# What Python's faulthandler (on in every Ray worker) and abseil's failure handler print on a fatal
# signal, before the process ends: the signal a died rank's last output names.
_FATAL = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
_FATAL_NAMES = "|".join(map(re.escape, _FATAL))
_FATAL_RE = re.compile(rf"Fatal Python error: ({_FATAL_NAMES})|\*\*\* (SIG[A-Z]+) received")


def death_cause(last_output: list[str] | tuple[str, ...], oom_kills: int | None) -> str | None:
    """Why a rank process died, when its last output or its node tells: a fatal signal that
    faulthandler reported, or the kernel's OOM killer at work on the node (`oom_kills` since the rank
    started, None where unknown). None when nothing tells."""
    for line in reversed(last_output):
        m = _FATAL_RE.search(line)
        if m:
            sig = _FATAL[m.group(1)] if m.group(1) else m.group(2)
            what = m.group(1).lower() if m.group(1) else "a fatal signal"
            return f"its process was killed by {sig} ({what}; its stack is in the last output)"
    if oom_kills:
        return (
            f"its process was killed (SIGKILL): the kernel's OOM killer killed {oom_kills} process(es) "
            "on its node meanwhile; give the ranks more memory (fewer ranks per node, smaller batches)"
        )
    if oom_kills == 0:
        return (
            "its process ended without a Python exception or a fatal-error report: os._exit(), or a "
            "signal sent from outside the job (SIGKILL, SIGTERM); not the kernel's OOM killer"
        )
    return None


# Ray's own C++ teardown, on a worker told to exit, now and then aborts on an abseil mutex check
# ("[mutex.cc : 1957] RAW: Check ... Mutex corrupt"): a crash of Ray's, after the program returned,
# seen once in a few hundred rank exits here.
_RAY_TEARDOWN = re.compile(r"\[mutex\.cc : \d+\] RAW: ")


def ray_teardown_crash(last_output: list[str] | tuple[str, ...]) -> bool:
    """Whether a process that died on its way out died in Ray's own teardown (its last output says
    so), not in the program's exit handlers."""
    return any(_RAY_TEARDOWN.search(line) for line in last_output[-20:])


# Lines of a crash dump that say nothing to the program's author: Ray's own failure handler (the
# same signal, again, with raw addresses), the list of extension modules, and stack frames of the
# launcher, Ray and runpy below the program's own.
_NOISE = re.compile(
    r"\] logging\.cc:\d+: |^PC: @|^\s+@\s+0x|^\*\*\* SIG[A-Z]+ received|^Extension modules: "
    r'|^\s+File "(<frozen runpy>|[^"]*/(ray|launcher/rank)/[^"]*)", line'
)


def readable_tail(lines: list[str] | tuple[str, ...], keep: int = 20) -> tuple[str, ...]:
    """A dead rank's last lines for the failure report, crash-dump noise left out (the rank's log
    keeps every line)."""
    kept = [ln for ln in lines if not _NOISE.search(ln)]
    while kept and not kept[-1].strip():
        kept.pop()
    return tuple(kept[-keep:])
