"""The run directory's `rank-<r>.log` files, as the output sink (driver/output/relay.py) writes them.

At thousands of ranks two costs show (bench/output_sim.py): creating a file takes 0.02-0.4 ms on
the machines measured, so the first lines of 8,192 ranks at once held the sink for seconds, behind
them the console's; and a file kept open per rank needs as many descriptors, past the usual soft
limit of 1,024. The files are created ahead, off the output path, by a thread (the console's ranks
first), and at most as many are kept open as the process's limit allows (raised to its hard
limit, driver/cluster/fds.py): the least recently written is closed first.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from ..cluster.fds import fd_budget

FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND


class RankFiles:
    """Append-only, owner-readable files (rank output can hold secrets), one per rank, written with
    one system call a batch of lines."""

    def __init__(self, folder: Path, ranks: int, first: Iterable[int] = ()):
        self.folder = folder
        self.open_max = fd_budget(ranks)
        self.fds: OrderedDict[int, int] = OrderedDict()  # written to, the least recently first
        self.lost: dict[int, int] = {}  # bytes of each rank's output that could not be written
        self.pending: dict[int, int] = {}  # of those, since the rank's last write that succeeded
        self.failed: str | None = None  # why the first write that failed did
        self.made: dict[int, int] = {}  # opened ahead by the thread, not yet written to
        self.closed = threading.Event()  # the thread stops opening files
        order = [*first, *range(ranks)]
        self.creator = threading.Thread(
            target=self._create, args=(order,), name="megaray-rank-files", daemon=True
        )
        self.creator.start()

    def path(self, rank: int) -> Path:
        return self.folder / f"rank-{rank}.log"

    def _create(self, order: list[int]) -> None:
        """Races with write(), harmlessly: O_CREAT on both sides, and a second descriptor of a file
        is closed with the others."""
        for rank in dict.fromkeys(order):
            if self.closed.is_set():
                return
            if rank in self.fds:
                continue
            with contextlib.suppress(OSError):
                fd = os.open(self.path(rank), FLAGS, 0o600)
                if len(self.made) + len(self.fds) < self.open_max:
                    self.made[rank] = fd
                else:
                    os.close(fd)

    def write(self, rank: int, text: str) -> str | None:
        """Append `text` to rank's file. A write that fails (a full disk, the run directory deleted)
        never stops the output, which the console still shows: what could not be written is counted
        (`lost`), marked in the file where writing resumes, and the first failure is returned, once,
        for the sink to say."""
        data = text.encode(errors="surrogateescape")  # the rank's bytes that were not UTF-8, as written
        size = len(data)  # the output's own bytes: a gap's mark is not counted as lost
        try:
            fd = self._fd(rank)
            if rank in self.pending:
                data = self._gap(rank).encode() + data
            while data:
                data = data[os.write(fd, data) :]
        except OSError as e:
            lost = min(size, len(data))
            self.lost[rank] = self.lost.get(rank, 0) + lost
            self.pending[rank] = self.pending.get(rank, 0) + lost
            if self.failed is None:
                self.failed = e.strerror or str(e)
                return self.failed
            return None
        self.pending.pop(rank, None)
        return None

    def _fd(self, rank: int) -> int:
        fd = self.fds.pop(rank, None)
        if fd is None:
            fd = self.made.pop(rank, None)
        if fd is None:
            while self.fds and len(self.fds) + len(self.made) >= self.open_max:
                os.close(self.fds.popitem(last=False)[1])
            fd = os.open(self.path(rank), FLAGS, 0o600)
        self.fds[rank] = fd
        return fd

    def _gap(self, rank: int) -> str:
        lost = self.pending[rank]
        return f"[megaray: {lost} bytes of this rank's output could not be written here ({self.failed})]\n"

    def lost_summary(self) -> str | None:
        """What the files are missing, for the console's last word on them."""
        if not self.lost:
            return None
        worst = sorted(self.lost, key=lambda r: -self.lost[r])[:8]
        each = ", ".join(f"rank-{r}.log {self.lost[r]}" for r in worst)
        more = f" and {len(self.lost) - len(worst)} more" if len(self.lost) > len(worst) else ""
        return f"{sum(self.lost.values())} bytes of rank output were not written ({each}{more})"

    def close(self) -> None:
        self.closed.set()
        self.creator.join(timeout=5)  # it stops after the file it is opening: none opened after this
        for fds in (self.fds, self.made):
            while fds:
                with contextlib.suppress(OSError):
                    os.close(fds.popitem()[1])
