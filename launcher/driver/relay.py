"""Rank output on the driver's side: a sink actor on the driver's node collects every rank's lines
(rank/capture.py sends them), writes `rank-<r>.log` into the run directory with `[r<rank> n<node>]`
prefixes, and holds the console lines and progress records until the driver drains them; the relay
shows them, times the activity that hang detection watches, and makes the final drain.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import ray

from ..core.progress import parse_megatron_line
from ..core.spec import RAY_NAMESPACE
from .actors import first_line, kill_actors, on_node
from .progress_view import ProgressView
from .stragglers import StragglerWatch

log = logging.getLogger("megaray")


CONTROL = "control"  # the sink's concurrency group for the ranks' stop waits (OutputSink)
CONTROL_SPARE = 8  # slots of that group beyond one per rank: the driver's stop_ranks, and a margin
LAST_LINES = 80  # of a dead rank's output, for the failure report (core/deaths.py trims them)


def prefix(rank: int, node_rank: int) -> str:
    return f"[r{rank} n{node_rank}] "


class OutputSink:
    """The driver node's collector (a Ray actor): per-rank files, console lines, progress records.

    It is also how the driver stops the ranks gracefully: each rank's control thread waits in
    `wait_stop()` (an async method, so that all of them wait at once) and sends its own process
    SIGTERM when `stop_ranks()` releases them. Those two run in their own concurrency group, sized for
    the world (`start_sink`): in the default group (1,000 calls at once for an async actor) a
    thousand ranks' waits would hold every slot, and no `write`, `drain` or `stop_ranks` would run.
    """

    def __init__(
        self,
        run_dir: str | None = None,
        node_of_rank: list[int] | None = None,
        console: frozenset[int] = frozenset(),
    ):
        if run_dir is not None:
            self.configure(run_dir, node_of_rank or [], console)
        self.files: dict[int, Any] = {}
        self.partial: dict[int, str] = {}
        self.received: dict[int, int] = {}  # bytes of each rank's spool written here
        self.decoders: dict[int, Any] = {}
        self.last: dict[int, deque[str]] = {}  # each rank's last lines, for a failure report
        self.console: list[str] = []
        self.progress: list[dict[str, Any]] = []
        self.writes = 0  # any rank's activity, for the driver's hang detection
        self._stop: asyncio.Event | None = None

    def configure(self, run_dir: str, node_of_rank: list[int], console: frozenset[int]) -> None:
        """For a launch: a sink started ahead (a pool's, driver/pool.py) learns it here."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.node_of_rank = node_of_rank
        self.console_ranks = console

    def _stop_event(self) -> asyncio.Event:
        if self._stop is None:  # created in the actor's event loop, where it is awaited
            self._stop = asyncio.Event()
        return self._stop

    @ray.method(concurrency_group=CONTROL)
    async def wait_stop(self) -> None:
        await self._stop_event().wait()

    @ray.method(concurrency_group=CONTROL)  # the event is the control group's loop's
    async def stop_ranks(self) -> None:
        self._stop_event().set()

    def write(self, rank: int, data: bytes, start: int) -> None:
        """Bytes `start`.. of a rank's spool, from the rank's thread or, after the process ended, from
        a task on its node (rank/spool.py): what both sent is written once."""
        self.writes += 1
        have, end = self.received.get(rank, 0), start + len(data)
        if end <= have:
            return
        self.received[rank] = end
        if start > have:  # a salvage sends the end of a long spool only
            gap = f"[megaray: {start - have} bytes of this rank's output were not received]\n"
            data = gap.encode() + data
        else:
            data = data[have - start :]
        decoder = self.decoders.setdefault(rank, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        lines = (self.partial.pop(rank, "") + decoder.decode(data)).split("\n")
        if lines[-1]:
            self.partial[rank] = lines[-1]
        self._lines(rank, lines[:-1])

    def _lines(self, rank: int, lines: list[str]) -> None:
        if not lines:
            return
        tag = prefix(rank, self.node_of_rank[rank])
        f = self.files.get(rank)
        if f is None:
            fd = os.open(self.dir / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            f = self.files[rank] = open(fd, "a", buffering=1)  # noqa: SIM115
        f.write("".join(tag + ln + "\n" for ln in lines))
        self.last.setdefault(rank, deque(maxlen=LAST_LINES)).extend(lines)
        for ln in lines:
            record = parse_megatron_line(ln)
            if record is not None:
                self.progress.append({**record, "rank": rank})
        if rank in self.console_ranks:
            self.console.extend(tag + ln for ln in lines)

    def received_bytes(self, rank: int) -> int:
        return self.received.get(rank, 0)

    def tail(self, rank: int) -> list[str]:
        """A rank's last lines, the unterminated one included."""
        rest = [self.partial[rank]] if self.partial.get(rank) else []
        return [*self.last.get(rank, ()), *rest][-LAST_LINES:]

    def report(self, rank: int, record: dict[str, Any]) -> None:
        """Progress sent by `launcher.progress.report()` on a rank."""
        self.writes += 1
        self.progress.append({**record, "rank": rank})

    def waits(self, rank: int, samples: int, waiting: int) -> None:
        """A rank's looks at its program (rank/waits.py), stamped here; not activity: a hung rank
        waits in its collective and keeps sending these."""
        self.progress.append({"rank": rank, "waits": (time.time(), samples, waiting)})

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


def start_sink(name: str, world_size: int, detached: bool = False, max_concurrency: int | None = None) -> Any:
    """The sink actor's class with its options: on the driver's node, which holds the run directory,
    with a slot in its control group for every rank's wait and for the driver's stop (Ray takes
    concurrency groups at the class, not in `.options()`). `max_concurrency` bounds the default
    group (Ray's default for an async actor: 1,000); a test sets it below the world size."""
    groups = {CONTROL: world_size + CONTROL_SPARE}
    bound = {"max_concurrency": max_concurrency} if max_concurrency else {}
    return ray.remote(concurrency_groups=groups)(OutputSink).options(
        **bound,
        name=name,
        namespace=RAY_NAMESPACE,
        max_restarts=0,
        lifetime="detached" if detached else None,
        **on_node(ray.get_runtime_context().get_node_id()),
    )


class OutputRelay:
    """The sink of one attempt, and what the driver has seen of the ranks through it."""

    def __init__(
        self,
        name: str,
        run_dir: Path,
        node_of_rank: list[int],
        console: frozenset[int],
        progress: ProgressView,
        started: Any = None,
        stragglers: StragglerWatch | None = None,
    ):
        """`started`: a sink already running on the driver's node (a pool's), else one is started.
        `stragglers` is given the ranks' wait samples."""
        self.progress = progress
        self.stragglers = stragglers
        self.sink: Any = started
        if started is not None:
            try:
                ray.get(started.configure.remote(str(run_dir.resolve()), node_of_rank, console), timeout=10)
            except (ray.exceptions.RayError, TimeoutError):
                kill_actors([started])
                self.sink = None
        if self.sink is None:
            self.sink = start_sink(name, len(node_of_rank)).remote(
                str(run_dir.resolve()), node_of_rank, console
            )
        self.drain_ref: Any = None
        self.writes_seen = 0  # the sink's count of rank writes and reports, when last drained
        self.last_activity = time.monotonic()
        self.progress_seen = False

    def pump(self, wait_s: float = 0.0) -> None:
        """Show what the sink collected since the last call: console lines and progress."""
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

    def catch_up(self, wait_s: float = 5.0) -> None:
        """Show everything the sink received up to now: a drain asked for earlier, then one asked now."""
        self.pump(wait_s)
        if self.drain_ref is None:
            self.pump(wait_s)

    def _show(self, lines: list[str], records: list[dict[str, Any]], writes: int) -> None:
        if writes != self.writes_seen:
            self.writes_seen, self.last_activity = writes, time.monotonic()
        self.progress.print_lines(lines)
        for record in records:
            if "waits" in record:
                if self.stragglers is not None:
                    self.stragglers.sample(record["rank"], *record["waits"])
                continue
            self.progress.update(record)
            self.progress_seen = True
        if self.stragglers is not None:
            self.stragglers.look()

    def stop_ranks(self) -> None:
        """SIGTERM to every rank still running (each sends it to itself, see OutputSink)."""
        if self.sink is not None:
            with contextlib.suppress(Exception):
                ray.get(self.sink.stop_ranks.remote(), timeout=5)

    def finish(self) -> None:
        """Last lines into the files and onto the console, then stop the sink."""
        if self.drain_ref is not None:
            self.pump(wait_s=5.0)  # lines already drained come before what finish() returns
        sink, self.sink = self.sink, None
        if sink is not None:
            with contextlib.suppress(Exception):  # the sink is gone: what it held is lost with it
                self._show(*ray.get(sink.finish.remote(), timeout=10))
            kill_actors([sink])
        self.progress.close()
