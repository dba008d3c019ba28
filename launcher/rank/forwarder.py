"""On each node of a launch: one forwarder (a Ray actor, no CPU reserved) between the node's ranks and
the driver's output sink (driver/output/relay.py), which the driver's node's forwarder holds in its own
process (driver/output/sink_host.py).

A rank's threads (rank/capture.py, rank/waits.py) call their node's forwarder, never the driver:
its output, its progress reports and wait samples, and the wait for a graceful stop. The forwarder
sends the sink one batch at a time (core/outbatch.py), so the driver's calls grow with the nodes,
not the ranks (8,192 ranks each sending ~30 writes a second would be 50-90 times what one actor
takes), and it holds a bounded amount: past that, a rank's write waits, and its output waits in its
spool on disk. The stop waits live here too, on the node, instead of a call per rank held open on
the driver's node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import ray

from ..core.deaths import ProcessEnd, RecordedProcess
from ..core.metrics import KEEP_EVERY_S, RankLabels
from ..core.outbatch import MIN_EVERY_S, Held, OutputBatch, Source, batch_bytes, send_every
from ..core.straggler import Sample
from .metrics import RankMetrics
from .serialization import in_a_ray_worker, serializers_when_imported

log = logging.getLogger("megaray")

if in_a_ray_worker():  # a forwarder's process, taking its class before its first arguments
    serializers_when_imported()

CONTROL = "control"  # the concurrency group of the stop waits: the default group stays free for output
CONTROL_SLOTS = 1024  # ranks of one node waiting for a stop at once, and the driver's stop
MAX_HELD_BYTES = 16 << 20  # what one node holds for the sink before its ranks' writes wait
ENDS_EVERY_S = 0.05  # how often the node's ranks' processes are looked at for one ending


class NodeForwarder:
    """The node's ranks' calls, gathered (rank/capture.py knows it as its sink: same methods)."""

    def __init__(self, sink: Any, console: frozenset[int], nodes: int, metrics: RankLabels | None = None):
        """`metrics`: the node's ranks' labels, to record their metrics by (None: --metrics off)."""
        self.sink = sink
        self.metrics = RankMetrics(metrics) if metrics is not None else None
        self.held = Held(console=console)
        self.budget, self.every = batch_bytes(nodes), send_every(nodes)
        self.added = 0  # calls that brought something to send
        self.acked = 0  # of those, how many the sink has: all before a batch that emptied what was held
        self.failed = False  # the sink is gone (the driver with it): output is dropped, nobody waits
        # an event binds to the loop that first waits on it: these, the default group's (output)
        self._wake = asyncio.Event()  # something to send
        self._urgent = asyncio.Event()  # what the console shows arrived: send it soon
        self._room = asyncio.Event()  # what was held went out: a waiting write may add
        self._stop = asyncio.Event()  # the control group's: the driver stops the ranks
        self._sender: asyncio.Task | None = None
        self._keeper: asyncio.Task | None = None  # sets the metrics' values again (rank/metrics.py)

    def _wake_sender(self, urgent: bool = False) -> None:
        """The sender runs in the default group's event loop, where output is handled: started there,
        on the first call."""
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send())
        self._wake.set()
        if urgent:
            self._urgent.set()

    async def write(self, source: Source, data: bytes, start: int) -> None:
        """Bytes `start`.. of one of a rank's spools; returns once there is room for them (the
        stream's one write in flight: rank/capture.py)."""
        while self.held.bytes >= MAX_HELD_BYTES and not self.failed:
            self._room.clear()
            await self._room.wait()
        self.held.add(source, data, start)
        self.added += 1
        self._wake_sender(urgent=source.rank in self.held.console)

    async def relabel(self, labels: RankLabels) -> None:
        """The ranks' coordinates (TP, PP, DP), once the preflight knows the layout: before the
        program starts, so before any report (driver/lifecycle/attempt.py)."""
        if self.metrics is not None:
            self.metrics.labels = labels

    async def reports(self, batch: list[tuple[int, dict[str, Any]]]) -> None:
        """A rank's report() calls since its output thread's last turn (rank/capture.py)."""
        for rank, record in batch:
            # progress only: not a checkpoint's start or end (launcher.checkpointing)
            if self.metrics is not None and "iteration" in record:
                self.metrics.report(rank, record)
            self.held.reports.append((rank, record))
        if self.metrics is not None:
            self._keep_metrics()
        self.added += 1
        self._wake_sender(urgent=True)

    async def sample(self, sample: Sample) -> None:
        """A rank's straggler sample (rank/waits.py, megatron/steptimes.py)."""
        if self.metrics is not None:
            self.metrics.sample(sample)
            self._keep_metrics()
        self.held.samples.append(sample)
        self.added += 1
        self._wake_sender()

    def _keep_metrics(self) -> None:
        """From the first value on, every KEEP_EVERY_S: a rank that stops reporting keeps its last
        values (its last progress above all), for as long as the attempt runs."""
        if self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(KEEP_EVERY_S)
            self.metrics.keep()

    async def flush(self) -> None:
        """Returns once what was held at the call has reached the sink (or the sink is gone): not
        what the node's other ranks print meanwhile, which may never stop."""
        target = self.added
        while self.acked < target and not self.failed:
            self._wake_sender(urgent=True)  # no gathering: someone waits
            await asyncio.sleep(0.01)

    async def _send(self) -> None:
        wake, room, urgent = self._wake, self._room, self._urgent
        while True:
            await wake.wait()
            wake.clear()
            # a burst of lines, gathered into one batch; the console's lines wait the least
            await asyncio.sleep(MIN_EVERY_S)
            if not self.held.for_console():
                urgent.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(urgent.wait(), self.every - MIN_EVERY_S)
            batch = self.held.take(self.budget)
            upto = None if self.held else self.added  # everything added so far is in this batch
            room.set()
            try:
                if batch and not self.failed:
                    await self._to_sink(batch)
                if upto is not None:
                    self.acked = max(self.acked, upto)
            except Exception as e:  # the sink is gone: the driver is going too
                log.warning("rank output is no longer sent to the driver: %s", e)
                self.failed = True
                room.set()
            if self.held:
                wake.set()

    async def ship(self, spools: list[tuple[Source, str]]) -> dict[str, Any]:
        """A dead rank's spool, sent to the sink from here (rank/spool.py `ship`): this process runs on
        the rank's node already, where a task would first wait for Ray to start a worker (seconds on
        a loaded machine, which left a crashed rank's last line out of its report)."""
        from .spool import oom_kills, unsent

        received = await self._sink_received([source for source, _ in spools])
        batch, shipped = unsent(spools, received, True)
        if batch is not None:
            await self._to_sink(batch)
        return {"shipped": shipped, "oom_kills": oom_kills()}

    async def _to_sink(self, batch: OutputBatch) -> None:
        """One batch into the launch's sink, which the driver's node's forwarder holds in its own
        process (driver/output/sink_host.py overrides these two)."""
        await self.sink.take.remote(batch)

    async def _sink_received(self, sources: list[Source]) -> list[int]:
        return await self.sink.received_of.remote(sources)

    @ray.method(concurrency_group=CONTROL)
    async def watch_ends(self, pids: list[int]) -> list[ProcessEnd]:
        """Returns once any of these processes (the node's ranks) is ending: the moment it starts to exit,
        seconds before Ray reports it dead where it held GPU memory (driver/supervision/rank_ends.py). One
        already gone at the first look is left to Ray's report: its pid may be another's by now."""
        from .probes import ending

        pids = [p for p in pids if (e := ending(p)) is None or e.status is not None]
        while pids:
            ends = [e for e in map(ending, pids) if e is not None]
            if ends:
                return ends
            await asyncio.sleep(ENDS_EVERY_S)
        # Nothing to watch: never answers. A sleep, not a bare Event().wait(): the loop's timer holds
        # the call, where an event only the call refers to may be collected with it mid-wait (asyncio
        # holds tasks weakly) and the driver told GeneratorExit, a dead forwarder to it.
        while True:
            await asyncio.sleep(3600)

    @ray.method(concurrency_group=CONTROL)
    async def exit_and_ship(
        self, procs: list[RecordedProcess], grace_s: float, spools: list[tuple[Source, str]],
        marks: list[str | None],
    ) -> list[tuple[float | None, bool, int | None]]:  # fmt: skip
        """rank/spool.py `exit_and_ship`, from this process, already running on the ranks' node: a task
        there would first wait for Ray to start a worker (about a second on a small machine, at the end
        of every launch with a node beside the driver's). The wait runs in a thread: the ranks' output
        and stop waits go on meanwhile."""
        from .spool import exits_seen

        ended = await asyncio.to_thread(exits_seen, procs, grace_s, marks)
        if spools:
            with contextlib.suppress(Exception):  # the sink is gone: the driver is going too
                await self.ship(spools)
        return ended

    @ray.method(concurrency_group=CONTROL)
    async def exit_marked(self, mark: str) -> bool:
        """rank/spool.py `exited_cleanly` on this node: whether a dead rank ended by `os._exit(0)`, asked
        of this process rather than of a task that would first wait for a worker to start."""
        from .spool import exited_cleanly

        return exited_cleanly(mark)

    @ray.method(concurrency_group=CONTROL)
    async def inspect(self, procs: list[RecordedProcess]) -> list[dict[str, Any]]:
        """rank/probes.py `inspect_processes` on this node (a hang's stacks), in a thread: the ranks'
        output and stop waits go on meanwhile."""
        from .probes import inspect_processes

        return await asyncio.to_thread(inspect_processes, procs)

    @ray.method(concurrency_group=CONTROL)
    async def wait_stop(self) -> None:
        """A rank's control thread waits here for the driver's stop (rank/capture.py)."""
        await self._stop.wait()

    @ray.method(concurrency_group=CONTROL)  # the event is the control group's loop's
    async def stop_ranks(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        for task in (self._sender, self._keeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
