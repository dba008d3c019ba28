"""The launch's output sink: every rank's lines (sent in batches by each node's forwarder,
rank/forwarder.py) written into `rank-<r>.log` in the run directory with `[r<rank> n<node>]`
prefixes, and the console lines (each with the stream it came from: a rank's stderr goes to the
launcher's stderr) and progress records held until the driver drains them. It runs inside the
forwarder of the driver's node (driver/output/sink_host.py), which holds the run directory.
"""

from __future__ import annotations

import codecs
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...core.deaths import ray_crash_line
from ...core.outbatch import STDERR, OutputBatch, Source, merged
from ...core.progress import parse_checkpoint_line, parse_megatron_line
from ...core.redraws import split_lines
from ...core.straggler import Sample
from .rankfiles import RankFiles

LAST_LINES = 80  # of a dead rank's output, for the failure report (core/deaths.py trims them)
BAR_EVERY_S = 1.0  # how often a bar redrawn with \r is shown as a line (core/redraws.py)


def _replaced(text: str) -> str:
    """`text` with the bytes that were not UTF-8 (decoded with surrogateescape) as U+FFFD: for the
    console and the report, while the rank's log keeps the bytes."""
    return text.encode(errors="surrogateescape").decode(errors="replace")


def prefix(rank: int, node_rank: int) -> str:
    return f"[r{rank} n{node_rank}] "


class OutputSink:
    """The driver node's collector: per-rank files, console lines, progress records; held by the
    forwarder of the driver's node (driver/output/sink_host.py), or alone in a test.

    Its calls come from one forwarder per node (`take`), from the driver (`drain`), and from a task
    on a node that ships a dead or exited rank's spool (`received_of`, `take`). None of them waits
    for another: the ranks' stop waits are held on their own nodes (rank/forwarder.py).
    """

    def __init__(
        self,
        run_dir: str | None = None,
        node_of_rank: list[int] | None = None,
        console: frozenset[int] = frozenset(),
    ):
        self.files: RankFiles | None = None
        if run_dir is not None:
            self.configure(run_dir, node_of_rank or [], console)
        self.partial: dict[Source, str] = {}  # each stream's unterminated last line
        self.bar_at: dict[Source, float] = {}  # when a bar redrawn with \r was last shown
        self.bar_shown: dict[Source, str] = {}  # its state then, until its line ends
        self.received: dict[Source, int] = {}  # bytes of each stream's spool written here
        self.decoders: dict[Source, Any] = {}
        self.last: dict[int, deque[str]] = {}  # each rank's last lines, for a failure report
        self.console: list[tuple[int, str]] = []  # (stream, line)
        self.progress: list[dict[str, Any]] = []
        self.reported = False  # progress in `progress` (not only wait samples): see `news`
        self.writes = 0  # any rank's activity, for the driver's hang detection

    def configure(self, run_dir: str, node_of_rank: list[int], console: frozenset[int]) -> None:
        """For a launch: a sink started ahead (a pool's, driver/cluster/pool.py) learns it here."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.node_of_rank = node_of_rank
        self.console_ranks = console
        self.files = RankFiles(self.dir, len(node_of_rank), first=sorted(console))

    def write(self, source: Source, data: bytes, start: int) -> None:
        """Bytes `start`.. of one of a rank's spools, in a node's batch (`take`): sent by the rank's
        thread or, after the process ended, shipped from its spool (rank/spool.py): what both sent
        is written once."""
        self.writes += 1
        have, end = self.received.get(source, 0), start + len(data)
        if end <= have:
            return
        self.received[source] = end
        if start > have:  # a salvage sends the end of a long spool only
            gap = f"[megaray: {start - have} bytes of this rank's output were not received]\n"
            data = gap.encode() + data
        else:
            data = data[have - start :]
        # bytes that are not UTF-8 reach the rank's log as they were written (surrogateescape), and
        # the console and the report as U+FFFD
        decoder = self.decoders.setdefault(
            source, codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        )
        lines, rest, bar = split_lines(self.partial.pop(source, "") + decoder.decode(data))
        if lines and lines[-1] == self.bar_shown.pop(source, None):
            lines.pop()  # the bar's last state, shown already, ended with its newline
        if rest:
            self.partial[source] = rest
        now = time.monotonic()
        if bar is not None and now - self.bar_at.get(source, 0.0) >= BAR_EVERY_S:
            self.bar_at[source], self.bar_shown[source] = now, bar  # a redrawn bar's state, now and then
            lines.append(bar)
        self._lines(source, lines)

    def _lines(self, source: Source, lines: list[str]) -> None:
        if not lines:
            return
        rank = source.rank
        tag = prefix(rank, self.node_of_rank[rank])
        text = "".join(tag + ln + "\n" for ln in lines)
        failed = self.files.write(rank, text)
        if not text.isascii():
            try:
                text.encode()
            except UnicodeEncodeError:  # bytes that were not UTF-8: the log has them, the rest U+FFFD
                lines = [_replaced(ln) for ln in lines]
        if failed is not None:  # said once: the console goes on, the files are counted short
            said = f"the rank logs in {self.dir} cannot be written ({failed}): the console goes on"
            self.console.append((STDERR, f"megaray: {said}; what is lost is counted at the end"))
        self.last.setdefault(rank, deque(maxlen=LAST_LINES)).extend(lines)
        for ln in lines:
            record = parse_megatron_line(ln)
            if record is not None:
                self._progress({**record, "rank": rank})
            elif (said := parse_checkpoint_line(ln)) is not None:
                phase, iteration = said
                self._progress(
                    {"rank": rank, "checkpoint": iteration, "phase": phase.value, "time": time.time()}
                )
        if rank in self.console_ranks:
            self.console.extend((source.stream, tag + ln) for ln in lines if not ray_crash_line(ln))

    def take(self, batch: OutputBatch) -> None:
        """A node's batch (rank/forwarder.py): output, progress, wait samples."""
        before = self.writes
        for source, start, data in merged(batch.chunks):
            self.write(source, data, start)
        for rank, record in batch.reports:
            self.report(rank, record)
        for sample in batch.samples:
            self.sample(sample)
        self.writes = before + batch.writes + len(batch.reports)  # the ranks' own writes, as before

    def received_bytes(self, source: Source) -> int:
        return self.received.get(source, 0)

    def received_of(self, sources: list[Source]) -> list[int]:
        """`received_bytes` of several spools in one call (a node's ship, rank/spool.py)."""
        return [self.received.get(s, 0) for s in sources]

    def tail(self, rank: int) -> list[str]:
        """A rank's last lines, the unterminated ones included."""
        rest = [_replaced(t) for source, t in sorted(self.partial.items()) if source.rank == rank and t]
        return [*self.last.get(rank, ()), *rest][-LAST_LINES:]

    def report(self, rank: int, record: dict[str, Any]) -> None:
        """Progress sent by `launcher.progress.report()` on a rank (in a node's batch)."""
        self.writes += 1
        self._progress({**record, "rank": rank})

    def _progress(self, record: dict[str, Any]) -> None:
        """Progress or a checkpoint for the driver: news (`news`), unlike a wait sample."""
        self.progress.append(record)
        self.reported = True

    def sample(self, sample: Sample) -> None:
        """A rank's straggler sample (core/straggler.py), stamped with this machine's monotonic clock
        (the driver's: the sink runs on its node); not activity: a hung rank waits in its collective
        and keeps sending looks at it."""
        self.progress.append({"rank": sample.rank, "sample": replace(sample, at=time.monotonic())})

    def news(self) -> bool:
        """Whether the driver has something to show: console lines or progress. Wait samples alone
        are not news: the straggler watch reads them in its own time (driver/output/sink_host.py
        answers a waiting drain on news)."""
        return bool(self.console) or self.reported

    def drain(self) -> tuple[list[tuple[int, str]], list[dict[str, Any]], int]:
        """Console lines (with their streams) and progress since the last call, and the count of
        writes so far."""
        out = (self.console, self.progress, self.writes)
        self.console, self.progress, self.reported = [], [], False
        return out

    def finish(self) -> tuple[list[tuple[int, str]], list[dict[str, Any]], int]:
        """Flush unterminated last lines and close the files; what is left for the console."""
        for source, decoder in self.decoders.items():  # a last character's bytes cut short
            if end := decoder.decode(b"", final=True):
                self.partial[source] = self.partial.get(source, "") + end
        for source, rest in sorted(self.partial.items()):
            self._lines(source, [rest])
        self.partial.clear()
        if self.files is not None:
            self.files.close()
            if lost := self.files.lost_summary():
                self.console.append((STDERR, f"megaray: {lost} in {self.dir}: {self.files.failed}"))
        return self.drain()
