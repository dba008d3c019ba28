"""Rank output: captured in each rank, collected through Ray, shown by the driver and kept per rank.

Ray's own log streaming prints every rank's lines with a long prefix and keeps them on the node
that produced them. Here each rank's stdout and stderr (the file descriptors, so NCCL's and other C
libraries' output too) go through a pipe to a sink actor on the driver's node. The sink writes
`rank-<r>.log` into the run directory, prefixes lines with `[r<rank> n<node>]`, and hands the
lines of the ranks chosen for the console, and any progress, to the driver when it asks. No shared
filesystem is needed.
"""

from __future__ import annotations

import codecs
import contextlib
import faulthandler
import fcntl
import os
import select
import signal
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

from .progress import parse_megatron_line


def parse_rank_list(text: str, world_size: int) -> frozenset[int]:
    """`--log-ranks`: "all", or ranks and ranges such as "0,3,8-11"."""
    if text.strip().lower() == "all":
        return frozenset(range(world_size))
    ranks: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"--log-ranks {text!r} must be 'all' or ranks such as 0,3,8-11")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first or last >= world_size:
            raise ValueError(
                f"--log-ranks {text!r} names rank {last}, but the world has {world_size} rank(s)"
            )
        ranks.update(range(first, last + 1))
    return frozenset(ranks)


def prefix(rank: int, node_rank: int) -> str:
    return f"[r{rank} n{node_rank}] "


_current: Capture | None = None


def current_sink() -> Any:
    """The sink this rank's output goes to (None outside a megaray launch)."""
    return _current.sink if _current is not None else None


class Capture:
    """In a rank: file descriptors 1 and 2 go to a pipe; a thread sends what arrives to the sink."""

    def __init__(self, sink: Any, rank: int):
        global _current
        _current = self
        self.sink, self.rank = sink, rank
        self.last_ref = None
        self.busy = False
        sys.stdout.flush()
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self.read_fd = read_fd
        # Python's own streams must not hold lines back: a rank that dies loses what is buffered.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(line_buffering=True)
        threading.Thread(target=self._pump, name="megaray-output", daemon=True).start()
        # On a hang the driver asks for this rank's stack where py-spy cannot attach.
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    def _pump(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while True:
            data = os.read(self.read_fd, 1 << 16)
            if not data:
                return
            self.busy = True
            # A moment's wait gathers a burst of lines into one message to the sink.
            deadline = time.monotonic() + 0.05
            while len(data) < 1 << 20:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                    break
                more = os.read(self.read_fd, 1 << 16)
                if not more:
                    break
                data += more
            self.last_ref = self.sink.write.remote(self.rank, decoder.decode(data))
            self.busy = False

    def sync(self, timeout_s: float = 10.0) -> None:
        """Return once everything written so far has reached the sink (before the rank reports)."""
        import ray

        sys.stdout.flush()
        sys.stderr.flush()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (self.busy or _unread(self.read_fd)):
            time.sleep(0.01)
        if self.last_ref is not None:
            ray.wait([self.last_ref], timeout=max(0.0, deadline - time.monotonic()))


def _unread(fd: int) -> int:
    buf = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return int.from_bytes(buf, sys.byteorder)


class OutputSink:
    """The driver node's collector (a Ray actor): per-rank files, console lines, progress records."""

    def __init__(self, run_dir: str, node_of_rank: list[int], console: frozenset[int]):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.node_of_rank = node_of_rank
        self.console_ranks = console
        self.files: dict[int, Any] = {}
        self.partial: dict[int, str] = {}
        self.console: list[str] = []
        self.progress: list[dict[str, Any]] = []
        self.writes = 0  # any rank's activity, for the driver's hang detection

    def write(self, rank: int, text: str) -> None:
        self.writes += 1
        lines = (self.partial.pop(rank, "") + text).split("\n")
        if lines[-1]:
            self.partial[rank] = lines[-1]
        self._lines(rank, lines[:-1])

    def _lines(self, rank: int, lines: list[str]) -> None:
        if not lines:
            return
        tag = prefix(rank, self.node_of_rank[rank])
        f = self.files.get(rank)
        if f is None:
            f = self.files[rank] = open(self.dir / f"rank-{rank}.log", "a", buffering=1)  # noqa: SIM115
        f.write("".join(tag + ln + "\n" for ln in lines))
        for ln in lines:
            record = parse_megatron_line(ln)
            if record is not None:
                self.progress.append({**record, "rank": rank})
        if rank in self.console_ranks:
            self.console.extend(tag + ln for ln in lines)

    def report(self, rank: int, record: dict[str, Any]) -> None:
        """Progress sent by `launcher.progress.report()` on a rank."""
        self.writes += 1
        self.progress.append({**record, "rank": rank})

    def drain(self) -> tuple[list[str], list[dict[str, Any]], int]:
        """Console lines and progress since the last call, and the count of writes so far."""
        out = (self.console, self.progress, self.writes)
        self.console, self.progress = [], []
        return out

    def finish(self) -> tuple[list[str], list[dict[str, Any]], int]:
        """Flush unterminated last lines and close the files; what is left for the console."""
        for rank, rest in sorted(self.partial.items()):
            self._lines(rank, [rest])
        self.partial.clear()
        for f in self.files.values():
            f.close()
        self.files.clear()
        return self.drain()
