"""The job's metrics, recorded by the driver through Ray's own export (`ray.util.metrics`: the
driver's node's metrics agent serves them): the controller's state, the current attempt's size,
restarts and failures by kind, the time lost to relaunches, the training's progress as the progress
view computes it, and each rank's straggler score. Per-rank training metrics are the nodes'
forwarders' (rank/metrics.py); names and labels are core/metrics.py's.

They live as long as the driver: Prometheus sees the series go when the launch ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ...core.errors import RankFailedError
from ...core.goodput import Ledger
from ...core.lifecycle import LaunchObserver, LaunchState, Restart
from ...core.metrics import (
    JOB,
    JOB_FAILURES,
    JOB_GOODPUT,
    JOB_GOODPUT_SECONDS,
    JOB_ITERATION,
    JOB_LAST_PROGRESS,
    JOB_LOSS,
    JOB_LOST_SECONDS,
    JOB_METRICS,
    JOB_MFU,
    JOB_NODES,
    JOB_RESTARTS,
    JOB_STATE,
    JOB_STEP_SECONDS,
    JOB_TFLOPS,
    JOB_TOKENS_PER_S,
    JOB_WORLD_SIZE,
    KEEP_EVERY_S,
    RANK_LABELS,
    RANK_METRICS,
    STRAGGLER_SCORE,
    MetricsMode,
    RankLabels,
    node_values,
)
from ...rank.metrics import Kept, ray_metrics

# the progress view's figures (driver/output/progress_view.py `stats`) and the metric each goes to
PROGRESS = {
    "iteration": JOB_ITERATION,
    "loss": JOB_LOSS,
    "iter_s": JOB_STEP_SECONDS,
    "tokens_per_s": JOB_TOKENS_PER_S,
    "tflops_per_gpu": JOB_TFLOPS,
    "mfu": JOB_MFU,
    "at": JOB_LAST_PROGRESS,
}


class JobMetrics(LaunchObserver):
    """The launch's metrics; every call is a no-op under `--metrics off`. Told of the controller's
    states, failures and restarts (a LaunchObserver), of each attempt's ranks (`attempt`), of progress
    (`progress`) and straggler scores (`scores`); a thread sets the values again every KEEP_EVERY_S
    (Ray's exporter drops a gauge not set lately: a launch waiting minutes for placement must still
    say so) until `close()`."""

    def __init__(
        self, job: str, mode: MetricsMode, clock: Callable[[], float] = time.time,
        goodput: Callable[[], Ledger | None] = lambda: None,
    ):  # fmt: skip
        """`goodput`: the launch's ledger so far (core/goodput.py), set again with the other values."""
        self.job, self.mode, self.clock, self.goodput = job, mode, clock, goodput
        self.tags = {JOB: job}
        self.kept: Kept | None = None
        if mode is not MetricsMode.OFF:
            metrics = JOB_METRICS.values()
            self.kept = ray_metrics(
                [*((m.name, m.description, m.labels) for m in metrics if not m.counter),
                 (STRAGGLER_SCORE, RANK_METRICS[STRAGGLER_SCORE].description, RANK_LABELS)],
                ((m.name, m.description, m.labels) for m in metrics if m.counter),
            )  # fmt: skip
        self.ranks: dict[int, RankLabels] = {}  # each rank's node's labels, for the straggler scores
        self.relaunched_at: float | None = None  # a relaunch was decided then and does not run yet
        self.stats: dict[str, Any] | None = None  # the progress last recorded
        self.done = threading.Event()
        self.on_state(LaunchState.PLACING)  # where a controller starts
        if self.kept is not None:
            threading.Thread(target=self._keep, name="megaray-metrics", daemon=True).start()

    def _keep(self) -> None:
        while not self.done.wait(KEEP_EVERY_S):
            self.spent(self.goodput())
            self.kept.keep()

    def close(self, spent: Ledger | None = None) -> None:
        """The last values set (the state the launch ended in, its final ledger), and no more."""
        self.done.set()
        if self.kept is not None:
            self.spent(spent)
            self.kept.keep()

    def spent(self, ledger: Ledger | None) -> None:
        """Where the launch's time went so far (core/goodput.py): nothing before a first report."""
        if ledger is None:
            return
        for cause, seconds in ledger.seconds.items():
            self._set(JOB_GOODPUT_SECONDS, seconds, cause=cause.value)
        self._set(JOB_GOODPUT, ledger.ratio)

    def _set(self, name: str, value: float, **labels: str) -> None:
        if self.kept is not None:
            self.kept.set(name, value, {**self.tags, **labels})

    def _inc(self, name: str, value: float, **labels: str) -> None:
        if self.kept is not None:
            self.kept.inc(name, value, {**self.tags, **labels})

    # -- told by the controller ---------------------------------------------------------------------
    def on_state(self, state: LaunchState) -> None:
        for each in LaunchState:
            self._set(JOB_STATE, float(each is state), state=each.value)
        if state is LaunchState.RUNNING and self.relaunched_at is not None:
            self._inc(JOB_LOST_SECONDS, self.clock() - self.relaunched_at)
            self.relaunched_at = None

    def on_failure(self, failure: RankFailedError) -> None:
        self._inc(JOB_FAILURES, 1, kind=str(failure.root.kind))

    def on_restart(self, restart: Restart) -> None:
        self._inc(JOB_RESTARTS, 1, kind=str(restart.kind))
        self.relaunched_at = restart.at

    # -- told by the attempt ------------------------------------------------------------------------
    def attempt(self, world_size: int, nodes: int, labels: dict[str, RankLabels]) -> None:
        self._set(JOB_WORLD_SIZE, world_size)
        self._set(JOB_NODES, nodes)
        self.ranks = {rank: node for node in labels.values() for rank in node.ranks}
        if self.kept is not None:  # the last attempt's ranks and nodes: this one's are set at its first look
            self.kept.forget(STRAGGLER_SCORE)

    def progress(self, stats: dict[str, Any]) -> None:
        """The progress view's figures, when they changed."""
        if stats is self.stats or not stats:
            return
        self.stats = stats
        for key, name in PROGRESS.items():
            if isinstance(stats.get(key), int | float):
                self._set(name, float(stats[key]))

    def scores(self, scores: dict[int, float]) -> None:
        """Each rank's straggler score (core/straggler.py); per node, the node's highest."""
        if self.kept is None:
            return
        by_rank = {r: {STRAGGLER_SCORE: s} for r, s in scores.items() if r in self.ranks}
        if self.mode is MetricsMode.NODE:
            nodes: dict[str, dict[int, dict[str, float]]] = {}
            for rank, values in by_rank.items():
                nodes.setdefault(self.ranks[rank].ranks[rank]["node"], {})[rank] = values
            by_rank = {next(iter(ranks)): node_values(ranks) for ranks in nodes.values()}
        for rank, values in by_rank.items():
            self.kept.set(STRAGGLER_SCORE, values[STRAGGLER_SCORE], self.ranks[rank].tags(rank))
