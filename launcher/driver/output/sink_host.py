"""The forwarder of the driver's node, holding the launch's output sink in its own process: one actor
fewer per launch than a sink of its own (a Ray worker's start and `import ray`, ~1.5 CPU-s, on the
way to every launch's first line), and the driver's node's ranks' lines reach the sink without a
call between processes.

The other nodes' forwarders, the tasks that ship a dead rank's spool and the driver call the sink's
methods on it (`take`, `received_of`, `tail`, `drain`, `finish`); the node's own ranks call it as
they call any node's forwarder (rank/forwarder.py). An async actor runs its default group's calls
on one event loop, so the sink's state is touched by one thread; the stop waits are the control
group's, as on every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

from ...core.metrics import RankLabels
from ...core.outbatch import OutputBatch, Source, batch_bytes, send_every
from ...rank.forwarder import NodeForwarder
from ...rank.metrics import RankMetrics
from .sink import OutputSink

# A waiting drain answers news no sooner than this after its last answer: a busy console is shown a
# batch at a time, not a call per line (at most ~10 a second beside the driver's turns)
DRAIN_GAP_S = 0.1


class SinkForwarder(NodeForwarder):
    """`SinkForwarder(run_dir, node_of_rank, console)`: as `OutputSink`'s; one started ahead (a
    pool's, driver/cluster/pool.py) learns them with `configure`, and is given `pool_group`, the
    name of a placement group of its pool: once that is gone (the pool given back by `megaray down`
    or when idle) and no launch took it, it ends itself. `down` stops the pool's sinks by name too;
    a detached actor must not outlive its pool by any path (one did, in a CI run, unexplained)."""

    def __init__(
        self,
        run_dir: str | None = None,
        node_of_rank: list[int] | None = None,
        console: frozenset[int] = frozenset(),
        pool_group: str | None = None,
    ):
        super().__init__(None, console, 1)
        self.local = OutputSink(run_dir, node_of_rank, console)
        self.configured = run_dir is not None
        self._changed = asyncio.Event()  # news in the sink, or a wake: a waiting drain looks again
        self._woken: set[str] = set()  # the drains the driver woke (see `drain`)
        self._drained_at = 0.0
        if pool_group is not None:
            threading.Thread(
                target=self._end_with, args=(pool_group,), name="megaray-sink-pool", daemon=True
            ).start()

    def _end_with(self, pool_group: str, every_s: float = 2.0) -> None:
        import ray

        while not self.configured:
            time.sleep(every_s)
            try:
                ray.util.get_placement_group(pool_group)
            except ValueError:  # removed: the pool was given back
                if not self.configured:
                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    async def _to_sink(self, batch: OutputBatch) -> None:
        self.take_now(batch)

    def take_now(self, batch: OutputBatch) -> None:
        """A batch into the sink, and a waiting drain told when it brought news."""
        self.local.take(batch)
        if self.local.news():
            self._changed.set()

    async def _sink_received(self, sources: list[Source]) -> list[int]:
        return self.local.received_of(sources)

    async def configure(self, run_dir: str, node_of_rank: list[int], console: frozenset[int]) -> None:
        self.configured = True
        self.local.configure(run_dir, node_of_rank, console)
        self.held.console = console

    async def serve(self, nodes: int, metrics: RankLabels | None) -> None:
        """As the forwarder of its node in a launch of `nodes` nodes, recording its ranks' metrics
        with `metrics` (None: --metrics off)."""
        self.budget, self.every = batch_bytes(nodes), send_every(nodes)
        self.metrics = RankMetrics(metrics) if metrics is not None else None

    # the sink's calls, from the other nodes' forwarders, the spools' shippers and the driver
    async def take(self, batch: OutputBatch) -> None:
        self.take_now(batch)

    async def received_of(self, sources: list[Source]) -> list[int]:
        return self.local.received_of(sources)

    async def tail(self, rank: int) -> list[str]:
        return self.local.tail(rank)

    async def drain(
        self, wait_s: float = 0.0, token: str = ""
    ) -> tuple[list[tuple[int, str]], list[dict[str, Any]], int]:
        """What the sink holds for the driver (`OutputSink.drain`). With `wait_s`, a long poll: answered
        once there is news (console lines, progress; no sooner than DRAIN_GAP_S after the last
        answer), after `wait_s`, or at once when the driver calls `wake(token)` (it wants what there
        is now). The driver waits for it beside the ranks' ends (driver/supervision/supervise.py):
        a line is shown when it reaches the sink, not at the driver's next turn. A wake names its
        drain: Ray may start an async actor's calls out of order, and a sink may serve a later
        relay (a pool's)."""
        deadline = time.monotonic() + wait_s
        while token not in self._woken and (now := time.monotonic()) < deadline:
            wait = deadline - now
            if self.local.news():
                if (gap := self._drained_at + DRAIN_GAP_S - now) <= 0:
                    break
                wait = min(wait, gap)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait)
        self._woken.discard(token)
        self._drained_at = time.monotonic()
        return self.local.drain()

    async def wake(self, token: str) -> None:
        """The drain asked with `token` answers now, or at once if it has not started (see `drain`);
        a wake that came after its drain had answered is kept, one short string."""
        self._woken.add(token)
        self._changed.set()

    async def finish(self) -> tuple[list[tuple[int, str]], list[dict[str, Any]], int]:
        """What this node's ranks sent last is in the sink (`flush` first), then the sink's finish."""
        await self.flush()
        return self.local.finish()
