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

import threading
import time
from typing import Any

from ...core.metrics import RankLabels
from ...core.outbatch import OutputBatch, Source, batch_bytes, send_every
from ...rank.forwarder import NodeForwarder
from ...rank.metrics import RankMetrics
from .sink import OutputSink


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
        self.local.take(batch)

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
        self.local.take(batch)

    async def received_of(self, sources: list[Source]) -> list[int]:
        return self.local.received_of(sources)

    async def tail(self, rank: int) -> list[str]:
        return self.local.tail(rank)

    async def drain(self) -> tuple[list[tuple[int, str]], list[dict[str, Any]], int]:
        return self.local.drain()

    async def finish(self) -> tuple[list[tuple[int, str]], list[dict[str, Any]], int]:
        """What this node's ranks sent last is in the sink (`flush` first), then the sink's finish."""
        await self.flush()
        return self.local.finish()
