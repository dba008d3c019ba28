"""Why a rank's process died, told from what is left of it: Ray's death message, the rank's last
output (Python's faulthandler, on in every Ray worker, prints the fatal signal and the stack), and
the node's OOM-killer count. Ray itself says only that the worker "exited unexpectedly"."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

PF_EXITING = 0x4  # the kernel's flag of a task inside exit(): set first, before its memory is freed
SIGKILL_PENDING = 1 << (signal.SIGKILL - 1)  # its bit in /proc/<pid>/status's SigPnd and ShdPnd masks


@dataclass(frozen=True)
class RecordedProcess:
    """A process megaray started, as recorded when it started: its pid and its start time (clock
    ticks after boot, /proc/<pid>/stat's 22nd field), so that a pid another process has taken since
    is never signalled. `started` None: not recorded (then the pid alone)."""

    pid: int
    started: int | None = None


@dataclass(frozen=True)
class ProcessEnd:
    """A rank's process found ending on its node, before it is gone: a process with GPU memory takes
    seconds to exit (the driver frees its memory first), and Ray reports it dead only after that.

    `status` is as waitpid(2) gives it (the low 7 bits a signal, else the exit code << 8); None when
    the process was gone before it could be read."""

    pid: int
    status: int | None

    @property
    def signal(self) -> int | None:
        return self.status & 0x7F or None if self.status is not None else None

    @property
    def clean(self) -> bool:
        """Exited with code 0 (os._exit(0)): not a failure of the rank, as under torchrun."""
        return self.status == 0

    @property
    def failed(self) -> bool:
        """Whether the node saw a failure: a non-zero exit or a signal. Not a clean exit, and not a
        process that vanished (status unknown)."""
        return self.status is not None and not self.clean

    @property
    def vanished(self) -> bool:
        """Seen running, then gone before a look caught it exiting: Ray's raylet, its parent, reaps a
        killed process within milliseconds. Its end is the rank's failure unless its exit mark says
        os._exit(0) (driver/supervision/rank_ends.py). Not left to Ray's report: Ray learns of a
        worker's death when its socket to the raylet closes, and children the rank forked hold it
        open; torch's DataLoader workers look for their parent every 5 s (a SIGKILL on an H100 was
        reported by Ray 5.0 s later, the rank a zombie at once)."""
        return self.status is None

    @property
    def exit_code(self) -> int | None:
        """As torch elastic reports a worker's: the code, or minus the signal."""
        if self.status is None:
            return None
        return -self.signal if self.signal else (self.status >> 8) & 0xFF

    def describe(self) -> str:
        if self.status is None:
            return "its process ended (found gone on its node)"
        if self.signal:
            return f"its process was killed by {_signal_name(self.signal)} (signal {self.signal})"
        return f"its process exited with code {self.exit_code} (os._exit or a crash outside Python)"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def process_end(pid: int, stat_text: str | None, status_text: str | None) -> ProcessEnd | None:
    """Whether a process is ending, from /proc/<pid>/stat and /proc/<pid>/status (None: gone): a
    zombie, a task with PF_EXITING (its exit status is already in stat's 52nd field), or one with a
    SIGKILL pending (nothing can stop it now). None while it runs on."""
    if stat_text is None:
        return ProcessEnd(pid, None)
    try:  # the command name may hold spaces and parentheses: the fields follow the last ')'
        fields = stat_text[stat_text.rindex(")") + 2 :].split()
        state, flags = fields[0], int(fields[6])
        code = int(fields[49]) if len(fields) > 49 else None
    except (ValueError, IndexError):
        return None
    if state in ("Z", "X") or flags & PF_EXITING:
        return ProcessEnd(pid, code)
    for line in (status_text or "").splitlines():
        key, _, mask = line.partition(":")
        if key in ("SigPnd", "ShdPnd") and int(mask.strip() or "0", 16) & SIGKILL_PENDING:
            return ProcessEnd(pid, signal.SIGKILL)
    return None


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


def death_cause(
    last_output: list[str] | tuple[str, ...], oom_kills: int | None, ended: ProcessEnd | None = None
) -> str | None:
    """Why a rank process died, when its last output or its node tells: a fatal signal that
    faulthandler reported, or the kernel's OOM killer at work on the node (`oom_kills` since the rank
    started, None where unknown), or its exit status as its node saw it end (`ended`). None when
    nothing tells."""
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
    if ended is not None and ended.status is not None:
        outside = (
            ", not by the kernel's OOM killer: a signal sent from outside the job (kill, Ray's memory "
            "monitor, a node agent)"
        )
        return ended.describe() + (outside if ended.signal and oom_kills == 0 else "")
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
# same signal, again, with raw addresses) and the list of extension modules; in the failure report,
# stack frames of the launcher, Ray and runpy below the program's own too.
_RAY_CRASH = r"\] logging\.cc:\d+: |^PC: @|^\s+@\s+0x|^\*\*\* SIG[A-Z]+ received|^Extension modules: "
_RAY_FRAME = r'|^\s+File "(<frozen runpy>|[^"]*/(ray|launcher/rank)/[^"]*)", line'  # any stack's
_NOISE = re.compile(_RAY_CRASH + _RAY_FRAME)
# on the console, only faulthandler's frames (`line N in f`, no comma: not a Python traceback's) of
# Ray's worker loop and megaray's rank code, below the program's own
_CRASH_DUMP = re.compile(_RAY_CRASH + _RAY_FRAME + r" \d+ in ")


def ray_crash_line(line: str) -> bool:
    """A line Ray's failure handler adds to a crashing rank's output (or the extension-module list, or
    a frame of Ray's or megaray's in faulthandler's stack): kept in the rank's log, off the console,
    where torchrun's users see the program's own lines."""
    return _CRASH_DUMP.search(line) is not None


LINE_HEAD, LINE_END = 1000, 200  # of a long line in the report: its start and its end


def _shortened(line: str) -> str:
    """A line of the report at most about 1,300 characters: a dying rank's megabytes without a
    newline went whole into the console and summary.json (the rank's log keeps the line)."""
    if len(line) <= LINE_HEAD + LINE_END + 100:
        return line
    left = len(line) - LINE_HEAD - LINE_END
    cut = f" [... {left} characters left out: the rank's log has the line ...] "
    return line[:LINE_HEAD] + cut + line[-LINE_END:]


def readable_tail(lines: list[str] | tuple[str, ...], keep: int = 20) -> tuple[str, ...]:
    """A dead rank's last lines for the failure report, crash-dump noise left out and long lines
    shortened (the rank's log keeps every line whole)."""
    kept = [ln for ln in lines if not _NOISE.search(ln)]
    while kept and not kept[-1].strip():
        kept.pop()
    return tuple(_shortened(ln) for ln in kept[-keep:])
