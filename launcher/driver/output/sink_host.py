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

from typing import Any

from ...core.metrics import RankLabels
from ...core.outbatch import OutputBatch, Source, batch_bytes, send_every
from ...rank.forwarder import NodeForwarder
from ...rank.metrics import RankMetrics
from .sink import OutputSink


class SinkForwarder(NodeForwarder):
    """`SinkForwarder(run_dir, node_of_rank, console)`: as `OutputSink`'s; one started ahead (a
    pool's, driver/cluster/pool.py) learns them with `configure`."""

    def __init__(
        self,
        run_dir: str | None = None,
        node_of_rank: list[int] | None = None,
        console: frozenset[int] = frozenset(),
    ):
        super().__init__(None, console, 1)
        self.local = OutputSink(run_dir, node_of_rank, console)

    async def _to_sink(self, batch: OutputBatch) -> None:
        self.local.take(batch)

    async def _sink_received(self, sources: list[Source]) -> list[int]:
        return self.local.received_of(sources)

    async def configure(self, run_dir: str, node_of_rank: list[int], console: frozenset[int]) -> None:
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
