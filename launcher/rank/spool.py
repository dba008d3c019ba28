"""A rank's output spools: the files on its node that its stdout and its stderr are written to.

The rank's own thread sends what the file receives on, to the launch's sink (rank/capture.py), but a
process that dies abruptly (`os._exit`, a segfault, SIGKILL) takes that thread with it, and with a
pipe its last lines would die too. A file keeps every byte the process wrote: after a rank dies, or
after the processes of a finished launch have ended (atexit output), a task on the node ships what
the sink has not yet received (`ship`). The spool lives beside Ray's own worker logs, where users
look for a worker's output, under a name Ray's log monitor does not tail.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, NoReturn

from ..core.deaths import RecordedProcess
from ..core.outbatch import STDERR, STDOUT, Source

MAX_SALVAGE_BYTES = 4 << 20  # what a dead rank's spool can add at most: its end, not a lost gigabyte


def log_dir() -> str:
    """Where this node keeps worker output: the folder of this worker's stderr file (Ray's session
    `logs/`), or a private folder under the temp dir when stderr is not a file."""
    with contextlib.suppress(OSError):
        path = os.readlink("/proc/self/fd/2")
        if path.startswith("/") and os.path.isdir(os.path.dirname(path)):
            return os.path.dirname(path)
    here = os.path.join(tempfile.gettempdir(), f"megaray-{os.getuid()}")
    os.makedirs(here, mode=0o700, exist_ok=True)
    return here


def spool_name(job: str, rank: int, pid: int) -> str:
    """The stdout spool's; its stderr's is `err_spool` of it."""
    return f"megaray-{job}-rank{rank}-{pid}.out"


def err_spool(spool: str) -> str:
    return spool.removesuffix(".out") + ".err"


def spool_files(rank: int, spool: str) -> list[tuple[Source, str]]:
    """A rank's two spools, by the stream each holds."""
    return [(Source(rank, STDOUT), spool), (Source(rank, STDERR), err_spool(spool))]


def exit_mark(spool: str) -> str:
    """The file a rank's process writes as the last of its exit handlers (rank/actor.py): one whose
    process ended without it died on the way out (a signal, os._exit), which under torchrun is the
    worker's exit status, a failure."""
    return spool + ".exit"


def mark_exit(path: str) -> None:
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))


def mark_os_exit_zero(path: str) -> None:
    """From now on, this process's `os._exit(0)` writes the exit mark `path` first: the program
    ended the process at once, exit handlers skipped, with status 0, which torchrun counts as the
    worker's success, while Ray says only that the worker died. A forked child's `os._exit(0)`
    (multiprocessing ends its children so) is not the rank's: its pid differs, no mark."""
    real, pid = os._exit, os.getpid()

    def _exit(status: int) -> NoReturn:
        if status == 0 and os.getpid() == pid:
            mark_exit(path)
        real(status)

    _exit.__doc__, _exit.__wrapped__ = real.__doc__, real  # type: ignore[attr-defined]
    os._exit = _exit


def exited_cleanly(path: str) -> bool:
    """Whether the exit mark `path` was written (read on the rank's node)."""
    return os.path.exists(path)


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed on this machine since boot."""
    with contextlib.suppress(OSError, ValueError):
        for line in open("/proc/vmstat"):  # noqa: SIM115
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return None


def read_from(path: str, start: int) -> tuple[int, bytes]:
    """The bytes of `path` from `start` (at most the last MAX_SALVAGE_BYTES), and where they begin."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            begin = max(start, size - MAX_SALVAGE_BYTES)
            f.seek(begin)
            return begin, f.read()
    except OSError:
        return start, b""


def ship(sink: Any, spools: list[tuple[Source, str]], delete: bool) -> dict[str, Any]:
    """On a node: send the sink what each of the ranks' spools (`spool_files`) holds beyond what the
    sink received; delete the spools when their processes have ended. Returns the bytes shipped by
    rank and the node's OOM kill count."""
    import ray

    received = ray.get(sink.received_of.remote([source for source, _ in spools]))
    batch, shipped = unsent(spools, received, delete)
    if batch is not None:
        ray.get(sink.take.remote(batch))
    return {"shipped": shipped, "oom_kills": oom_kills()}


def unsent(spools: list[tuple[Source, str]], received: list[int], delete: bool) -> tuple[Any, dict[int, int]]:
    """What the spools hold beyond what the sink `received` of each, as one batch for the node (not
    one call per rank; at most 4 MiB a spool, MAX_SALVAGE_BYTES), None when nothing; and the bytes
    by rank. Deletes the spools when their processes have ended."""
    from ..core.outbatch import OutputBatch

    chunks, shipped = [], {}
    for (source, path), start in zip(spools, received, strict=True):
        begin, data = read_from(path, start)
        shipped[source.rank] = shipped.get(source.rank, 0) + len(data)
        if data:
            chunks.append((source, begin, data))
        if delete:
            with contextlib.suppress(OSError):
                os.unlink(path)
    return (OutputBatch(tuple(chunks), writes=len(chunks)) if chunks else None), shipped


def exit_and_ship(
    procs: list[RecordedProcess], grace_s: float, sink: Any, spools: list[tuple[Source, str]],
    marks: list[str | None],
) -> list[tuple[float | None, bool, int | None]]:  # fmt: skip
    """On a node, after the program returned: watch the processes end (`exits_seen`), then ship what
    they printed on the way out (atexit handlers, non-daemon threads)."""
    ended = exits_seen(procs, grace_s, marks)
    if sink is not None and spools:
        with contextlib.suppress(Exception):  # the sink is gone: the driver is going too
            ship(sink, spools, delete=True)
    return ended


def exits_seen(
    procs: list[RecordedProcess], grace_s: float, marks: list[str | None]
) -> list[tuple[float | None, bool, int | None]]:
    """Watch the processes end (probes.wait_exited); for each: the seconds it took (None: killed after
    `grace_s`), whether it ended cleanly (its exit mark written, then removed; True where it has
    none to write), and its exit status where it was seen exiting."""
    from .probes import wait_exited

    took, status = wait_exited(procs, grace_s)
    clean = []
    for mark in marks:
        clean.append(mark is None or os.path.exists(mark))
        if mark is not None:
            with contextlib.suppress(OSError):
                os.unlink(mark)
    return list(zip(took, clean, status, strict=True))
