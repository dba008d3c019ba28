"""Rank output on the driver's side: a sink actor on the driver's node collects every rank's lines
(sent in batches by each node's forwarder, rank/forwarder.py), writes `rank-<r>.log` into the run
directory with `[r<rank> n<node>]` prefixes, and holds the console lines (each with the stream it
came from: a rank's stderr goes to the launcher's stderr) and progress records until the driver
drains them; the relay starts the forwarders, shows what arrives, times the activity that
hang detection watches, stops the ranks through the forwarders, and makes the final drain.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import logging
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from ...core.deaths import ray_crash_line
from ...core.metrics import RankLabels
from ...core.outbatch import STDERR, OutputBatch, Source, merged
from ...core.progress import parse_checkpoint_line, parse_megatron_line
from ...core.redraws import split_lines
from ...core.spec import RAY_NAMESPACE
from ...core.straggler import Sample
from ..gang.actors import first_line, kill_actors, on_node
from ..supervision.stragglers import StragglerWatch
from .progress_view import ProgressView
from .rankfiles import RankFiles

log = logging.getLogger("megaray")


LAST_LINES = 80  # of a dead rank's output, for the failure report (core/deaths.py trims them)
BAR_EVERY_S = 1.0  # how often a bar redrawn with \r is shown as a line (core/redraws.py)


def _replaced(text: str) -> str:
    """`text` with the bytes that were not UTF-8 (decoded with surrogateescape) as U+FFFD: for the
    console and the report, while the rank's log keeps the bytes."""
    return text.encode(errors="surrogateescape").decode(errors="replace")


def prefix(rank: int, node_rank: int) -> str:
    return f"[r{rank} n{node_rank}] "


class OutputSink:
    """The driver node's collector (a Ray actor): per-rank files, console lines, progress records.

    Its calls come from one forwarder per node (`take`), from the driver (`drain`), and from a task
    on a node that ships a dead or exited rank's spool (`received_of`, `write`). None of them waits
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
        self.writes = 0  # any rank's activity, for the driver's hang detection

    def configure(self, run_dir: str, node_of_rank: list[int], console: frozenset[int]) -> None:
        """For a launch: a sink started ahead (a pool's, driver/cluster/pool.py) learns it here."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.node_of_rank = node_of_rank
        self.console_ranks = console
        self.files = RankFiles(self.dir, len(node_of_rank), first=sorted(console))

    def write(self, source: Source, data: bytes, start: int) -> None:
        """Bytes `start`.. of one of a rank's spools, from the rank's thread or, after the process
        ended, from a task on its node (rank/spool.py): what both sent is written once."""
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
                self.progress.append({**record, "rank": rank})
            elif (saved := parse_checkpoint_line(ln)) is not None:
                self.progress.append({"rank": rank, "checkpoint": saved})
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

    def flush(self) -> None:
        """Nothing held here: a rank writing to the sink itself (a test) syncs as with a forwarder."""

    def received_bytes(self, source: Source) -> int:
        return self.received.get(source, 0)

    def received_of(self, sources: list[Source]) -> list[int]:
        """`received_bytes` of several spools in one call (a node's ship, rank/spool.py)."""
        return [self.received.get(s, 0) for s in sources]

    def tail(self, rank: int) -> list[str]:
        """A rank's last lines, the unterminated ones included."""
        rest = [_replaced(t) for source, t in sorted(self.partial.items()) if source.rank == rank and t]
        return [*self.last.get(rank, ()), *rest][-LAST_LINES:]

    def reports(self, batch: list[tuple[int, dict[str, Any]]]) -> None:
        """A rank's report() calls, sent to the sink itself (a test: rank/capture.py)."""
        for rank, record in batch:
            self.report(rank, record)

    def report(self, rank: int, record: dict[str, Any]) -> None:
        """Progress sent by `launcher.progress.report()` on a rank."""
        self.writes += 1
        self.progress.append({**record, "rank": rank})

    def sample(self, sample: Sample) -> None:
        """A rank's straggler sample (core/straggler.py), stamped with this machine's monotonic clock
        (the driver's: the sink runs on its node); not activity: a hung rank waits in its collective
        and keeps sending looks at it."""
        self.progress.append({"rank": sample.rank, "sample": replace(sample, at=time.monotonic())})

    def drain(self) -> tuple[list[tuple[int, str]], list[dict[str, Any]], int]:
        """Console lines (with their streams) and progress since the last call, and the count of
        writes so far."""
        out = (self.console, self.progress, self.writes)
        self.console, self.progress = [], []
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


def start_sink(name: str, detached: bool = False) -> Any:
    """The sink actor's class with its options: on the driver's node, which holds the run directory.
    Its calls run one at a time (no async method): the nodes' batches, the driver's drains."""
    return _sink_class().options(
        name=name,
        namespace=RAY_NAMESPACE,
        max_restarts=0,
        lifetime="detached" if detached else None,
        **on_node(ray.get_runtime_context().get_node_id()),
    )


@functools.cache
def _sink_class() -> Any:
    """One Ray class for every launch: Ray exports each new one."""
    return ray.remote(OutputSink)


@functools.cache
def _forwarder_class() -> Any:
    """The stop waits in a group of their own (Ray takes concurrency groups at the class, not in
    `.options()`): in the default group, an async actor's 1,000 slots, they would hold the slots the
    output needs."""
    from ...rank.forwarder import CONTROL, CONTROL_SLOTS, NodeForwarder

    return ray.remote(concurrency_groups={CONTROL: CONTROL_SLOTS})(NodeForwarder)


def start_forwarders(
    sink: Any, node_ids: list[str], console: frozenset[int], metrics: dict[str, RankLabels] | None = None
) -> dict[str, Any]:
    """One forwarder on each node (rank/forwarder.py), reserving nothing: the handles are ready at
    once, and the ranks' calls wait in Ray until the forwarder's process is up. `metrics`: each
    node's ranks' labels, by node id (None: no metrics)."""
    cls = _forwarder_class()
    metrics = metrics or {}
    return {
        node: cls.options(max_restarts=0, **on_node(node)).remote(
            sink, console, len(node_ids), metrics.get(node)
        )
        for node in node_ids
    }


def open_sink(
    name: str, run_dir: Path, node_of_rank: list[int], console: frozenset[int], started: Any = None
) -> Any:
    """An attempt's sink, writing into `run_dir`: `started`, one already running on the driver's node
    (a pool's), once it took the attempt's layout, else one started now."""
    if started is not None:
        try:
            ray.get(started.configure.remote(str(run_dir.resolve()), node_of_rank, console), timeout=10)
            return started
        except (ray.exceptions.RayError, TimeoutError):
            kill_actors([started])
    return start_sink(name).remote(str(run_dir.resolve()), node_of_rank, console)


class OutputRelay:
    """The sink of one attempt, and what the driver has seen of the ranks through it."""

    def __init__(
        self,
        sink: Any,
        console: frozenset[int],
        progress: ProgressView,
        stragglers: StragglerWatch | None = None,
    ):
        """`sink`: the attempt's (`open_sink`); `console`: the ranks whose lines are shown;
        `stragglers` is given the ranks' wait samples."""
        self.progress = progress
        self.stragglers = stragglers
        self.sink: Any = sink
        self.console = console
        self.forwarders: dict[str, Any] = {}  # by node id
        self.lost: set[str] = set()  # nodes found lost: their forwarders are not waited for
        self.drain_ref: Any = None
        self.writes_seen = 0  # the sink's count of rank writes and reports, when last drained
        self.last_activity = time.monotonic()
        self.progress_seen = False
        self.last_checkpoint_at: float | None = None  # when a rank last said a checkpoint was saved

    def forward_from(
        self, node_ids: set[str], metrics: dict[str, RankLabels] | None = None
    ) -> dict[str, Any]:
        """The forwarder each node's ranks send to (one attempt's nodes), started now: before the
        ranks, so that their starts overlap; each records its ranks' metrics with `metrics[node]`."""
        if self.sink is not None and not self.forwarders:
            self.forwarders = start_forwarders(self.sink, sorted(node_ids), self.console, metrics)
        return self.forwarders

    def nodes_lost(self, node_ids: set[str]) -> None:
        """Nodes found lost (a cut link, a dead machine): nothing is asked of their forwarders from now
        on, which would answer nothing (each wait below was its whole timeout, 10 s of the exit)."""
        self.lost |= node_ids

    def _tell_forwarders(self, method: str, timeout_s: float) -> None:
        """Call `method` on every node's forwarder at once and wait for them all, up to `timeout_s`
        (a node gone answers nothing; one known lost is not asked)."""
        refs = [getattr(f, method).remote() for node, f in self.forwarders.items() if node not in self.lost]
        if refs:
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def flush(self, timeout_s: float = 5.0) -> None:
        """What the forwarders hold, into the sink."""
        self._tell_forwarders("flush", timeout_s)

    def pump(self, wait_s: float = 0.0, again: bool = True) -> None:
        """Show what the sink collected: the drain asked at the last call once it is back (waited for
        up to `wait_s`), then ask the next one (`again`), which the next call shows: a line waits for
        one turn of the supervision, not two."""
        if self.sink is None:
            return
        if self.drain_ref is None:
            self.drain_ref = self.sink.drain.remote()
        ready, _ = ray.wait([self.drain_ref], timeout=wait_s)
        if not ready:
            return
        ref, self.drain_ref = self.drain_ref, None
        try:
            lines, records, writes = ray.get(ref)
        except ray.exceptions.RayError as e:
            log.warning("rank output is no longer collected: %s", first_line(e))
            self.sink = None
            return
        self._show(lines, records, writes)
        if again:
            self.drain_ref = self.sink.drain.remote()

    def catch_up(self, wait_s: float = 5.0) -> None:
        """Show everything the ranks sent up to now: a drain asked for earlier, what the forwarders
        hold, then a drain asked now."""
        self.pump(wait_s, again=False)
        self.flush(wait_s)
        if self.drain_ref is None:
            self.pump(wait_s, again=False)

    def _show(self, lines: list[tuple[int, str]], records: list[dict[str, Any]], writes: int) -> None:
        if writes != self.writes_seen:
            self.writes_seen, self.last_activity = writes, time.monotonic()
        self.progress.print_lines(lines)
        for record in records:
            if "sample" in record:
                if self.stragglers is not None:
                    self.stragglers.sample(record["sample"])
                continue
            if "checkpoint" in record:
                self.last_checkpoint_at = time.monotonic()
                continue
            self.progress.update(record)
            self.progress_seen = True
        if self.stragglers is not None:
            self.stragglers.look()

    def stop_ranks(self) -> None:
        """SIGTERM to every rank still running: each waits for it on its node's forwarder and sends it
        to itself (rank/capture.py). The nodes are told together."""
        self._tell_forwarders("stop_ranks", timeout_s=5)

    def finish(self) -> None:
        """Last lines into the files and onto the console, then stop the forwarders and the sink."""
        if self.drain_ref is not None:
            self.pump(wait_s=5.0, again=False)  # lines already drained come before what finish() returns
        self.flush()
        kill_actors(self.forwarders.values())
        self.forwarders = {}
        sink, self.sink = self.sink, None
        if sink is not None:
            with contextlib.suppress(Exception):  # the sink is gone: what it held is lost with it
                self._show(*ray.get(sink.finish.remote(), timeout=10))
            kill_actors([sink])
        self.progress.close()
