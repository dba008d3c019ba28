"""Rank output on the driver's side: each node's forwarder (rank/forwarder.py) sends its ranks'
lines in batches to the launch's sink (driver/output/sink.py), which the forwarder of the driver's
node holds in its own process (driver/output/sink_host.py); the relay starts them, shows what
arrives, times the activity that hang detection watches, stops the ranks through the forwarders,
and makes the final drain.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import ray

from ...core.metrics import RankLabels
from ...core.progress import Phase
from ...core.spec import RAY_NAMESPACE
from ..gang.actors import first_line, kill_actors, on_node
from ..supervision.stragglers import StragglerWatch
from .progress_view import ProgressView

log = logging.getLogger("megaray")
# A drain's longest wait for news (driver/output/sink_host.py): what the hang timer knows of the ranks'
# activity is at most this old
LONG_POLL_S = 1.0


def start_sink(name: str, detached: bool = False) -> Any:
    """The sink's actor class with its options: the forwarder of the driver's node, which holds the
    run directory (driver/output/sink_host.py)."""
    return _sink_class().options(
        name=name,
        namespace=RAY_NAMESPACE,
        max_restarts=0,
        lifetime="detached" if detached else None,
        **on_node(ray.get_runtime_context().get_node_id()),
    )


@functools.cache
def _sink_class() -> Any:
    """One Ray class for every launch (Ray exports each new one)."""
    from .sink_host import SinkForwarder

    return _with_stop_waits(SinkForwarder)


@functools.cache
def _forwarder_class() -> Any:
    from ...rank.forwarder import NodeForwarder

    return _with_stop_waits(NodeForwarder)


def _with_stop_waits(cls: type) -> Any:
    """A forwarder's Ray class: the stop waits in a group of their own (Ray takes concurrency groups
    at the class, not in `.options()`): in the default group, an async actor's 1,000 slots, they
    would hold the slots the output needs."""
    from ...rank.forwarder import CONTROL, CONTROL_SLOTS

    return ray.remote(concurrency_groups={CONTROL: CONTROL_SLOTS})(cls)


def start_forwarders(
    sink: Any, node_ids: list[str], console: frozenset[int], metrics: dict[str, RankLabels] | None = None
) -> dict[str, Any]:
    """One forwarder on each node (rank/forwarder.py), reserving nothing: the handles are ready at
    once, and the ranks' calls wait in Ray until the forwarder's process is up. On the driver's node
    the sink is the forwarder (driver/output/sink_host.py). `metrics`: each node's ranks' labels, by
    node id (None: no metrics)."""
    cls, here = _forwarder_class(), ray.get_runtime_context().get_node_id()
    metrics = metrics or {}
    forwarders = {}
    for node in node_ids:
        if node == here:
            sink.serve.remote(len(node_ids), metrics.get(node))
            forwarders[node] = sink
        else:
            forwarders[node] = cls.options(max_restarts=0, **on_node(node)).remote(
                sink, console, len(node_ids), metrics.get(node)
            )
    return forwarders


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
        stragglers: StragglerWatch,
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
        self.drain_token = ""  # names the drain in flight, for `wake`
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
        up to `wait_s`; a waiting drain is woken for it), then ask the next one (`again`), a long
        poll that the supervision waits for beside the ranks' ends (`news`): a line is shown when
        it reaches the sink."""
        if self.sink is None:
            return
        if self.drain_ref is None:
            self.drain_ref = self._ask(0.0 if wait_s else LONG_POLL_S)
        elif wait_s:
            self.sink.wake.remote(self.drain_token)
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
            self.drain_ref = self._ask(LONG_POLL_S)

    def _ask(self, wait_s: float) -> Any:
        self.drain_token = uuid.uuid4().hex
        return self.sink.drain.remote(wait_s, self.drain_token)

    def news(self) -> Any:
        """The drain in flight, ready once the sink has something to show (None: none asked)."""
        return self.drain_ref

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
                self.stragglers.sample(record["sample"])
                continue
            if "checkpoint" in record:  # a line that says so, or `launcher.checkpointing`
                phase = Phase(record.get("phase", Phase.SAVED))
                if phase is Phase.SAVED:
                    self.last_checkpoint_at = time.monotonic()
                self.progress.goodput.checkpoint(
                    phase, record.get("time", time.time()), record.get("rank", 0)
                )
                continue
            self.progress.update(record)
            self.progress_seen = True
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
        sink, self.sink = self.sink, None
        kill_actors([f for f in self.forwarders.values() if f is not sink])  # the sink's: below
        self.forwarders = {}
        if sink is not None:
            with contextlib.suppress(Exception):  # the sink is gone: what it held is lost with it
                self._show(*ray.get(sink.finish.remote(), timeout=10))
            kill_actors([sink])
        self.progress.close()
