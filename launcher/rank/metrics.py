"""Metrics through Ray's own export (`ray.util.metrics`), kept alive: on each node, in its forwarder
(rank/forwarder.py), the node's ranks' metrics, from the reports and samples the forwarder passes on
anyway; the driver's job metrics (driver/output/metrics.py) use the same store. What is recorded, and how a
node's ranks combine under `--metrics node`, is core/metrics.py's."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..core.metrics import RANK_LABELS, RANK_METRICS, MetricsMode, RankLabels, RankTrack, node_values
from ..core.straggler import Sample


class Kept:
    """Ray gauges set from what `set()` stored, all at once by `keep()` (every KEEP_EVERY_S, by the
    owner's loop): a value that changes a hundred times a second costs one call to Ray a second, and
    a value that does not change is set again in time (Ray's exporter drops a gauge value not set
    within two export intervals: a state, a hung rank's last progress, must not vanish). Counters
    are Ray's own, incremented at once (cumulative, never dropped)."""

    def __init__(self, gauges: dict[str, Any], counters: dict[str, Any] | None = None):
        self.gauges, self.counters = gauges, counters or {}
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def set(self, name: str, value: float, tags: dict[str, str]) -> None:
        self.values[name, tuple(tags.items())] = value

    def inc(self, name: str, value: float, tags: dict[str, str]) -> None:
        if value > 0:
            with contextlib.suppress(Exception):  # metrics never stop a launch or a rank's output
                self.counters[name].inc(value, tags=tags)

    def forget(self, name: str) -> None:
        """`name`'s values are no longer set: Ray drops them after two export intervals."""
        self.values = {key: value for key, value in self.values.items() if key[0] != name}

    def keep(self) -> None:
        for (name, tags), value in list(self.values.items()):
            with contextlib.suppress(Exception):
                self.gauges[name].set(value, tags=dict(tags))


def ray_metrics(
    gauges: Iterable[tuple[str, str, tuple[str, ...]]],
    counters: Iterable[tuple[str, str, tuple[str, ...]]] = (),
) -> Kept:
    """`(name, description, labels)` of each gauge and counter, made in this process."""
    from ray.util.metrics import Counter, Gauge

    return Kept(
        {name: Gauge(name, description=d, tag_keys=labels) for name, d, labels in gauges},
        {name: Counter(name, description=d, tag_keys=labels) for name, d, labels in counters},
    )


class RankMetrics:
    """The node's ranks' figures (core/metrics.py `RankTrack`), taken and set in Ray's gauges by
    `keep()`; a report or sample only updates its rank's track."""

    def __init__(self, labels: RankLabels, clock: Callable[[], float] = time.time):
        self.labels, self.clock = labels, clock
        self.kept = ray_metrics((m.name, m.description, RANK_LABELS) for m in RANK_METRICS.values())
        self.tracks = {rank: RankTrack(labels.world_size, labels.peak_tflops) for rank in labels.ranks}

    def report(self, rank: int, record: dict[str, Any]) -> None:
        if rank in self.tracks:
            self.tracks[rank].report(record)

    def sample(self, sample: Sample) -> None:
        if sample.rank in self.tracks:
            self.tracks[sample.rank].sample(sample, self.clock())

    def keep(self) -> None:
        figures = {rank: track.window() for rank, track in self.tracks.items()}
        if self.labels.mode is MetricsMode.NODE:
            ranks = [rank for rank, values in figures.items() if values]
            figures = {ranks[0]: node_values({r: figures[r] for r in ranks})} if ranks else {}
        for rank, values in figures.items():
            tags = self.labels.tags(rank)
            for name, value in values.items():
                self.kept.set(name, value, tags)
        self.kept.keep()
