"""What megaray exports to Prometheus, decided without Ray: the metrics' names and labels, the values a
rank's report or timed step gives, a node's aggregate when ranks are too many to export one by one,
and the parallel coordinates of a rank.

The metrics go out through Ray's own export (`ray.util.metrics`, scraped from each node's metrics
agent, which Ray lists for Prometheus in its service-discovery file), so they appear wherever Ray's
do; Ray prefixes them `ray_` (`megaray_rank_step_seconds` is scraped as
`ray_megaray_rank_step_seconds`). Per-rank metrics are recorded by each node's forwarder
(rank/forwarder.py), which sees its ranks' reports and samples anyway, so they need no call more;
per-job ones by the driver (driver/output/metrics.py). The Grafana dashboard (examples/grafana/) reads these
names, and a test runs each of its queries against a real Prometheus.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .errors import FailureKind
from .goodput import Cause
from .layout import ParallelDims
from .lifecycle import LaunchState, RestartKind
from .progress import tflops_per_gpu
from .straggler import Sample, StepSample


class MetricsMode(StrEnum):
    """`--metrics`: a series per rank, per node (its ranks aggregated: far fewer series), or none."""

    RANK = "rank"
    NODE = "node"
    OFF = "off"


@dataclass(frozen=True)
class RankMetric:
    """A per-rank gauge; `aggregate` combines a node's ranks under `--metrics node`."""

    name: str
    description: str
    aggregate: Callable[[list[float]], float]


# labels of every per-rank series; the rank is empty under --metrics node, and the parallel
# coordinates are empty where the target does not know them (a plain program). The job's label is not
# `job`: Prometheus gives that one the scrape job's name (and renames ours `exported_job`).
JOB = "megaray_job"
RANK_LABELS = (JOB, "node", "rank", "tp", "pp", "dp")
JOB_LABELS = (JOB,)
# Ray's exporter drops a gauge's value that was not set again within two of its export intervals
# (10 s by default): a value that does not change (a state, a hung rank's last progress) is set again
# this often
KEEP_EVERY_S = 1.0

STEP_SECONDS = "megaray_rank_step_seconds"
TOKENS_PER_S = "megaray_rank_tokens_per_second"
LOSS = "megaray_rank_loss"
LEARNING_RATE = "megaray_rank_learning_rate"
ITERATION = "megaray_rank_iteration"
TFLOPS = "megaray_rank_tflops"
MFU = "megaray_rank_mfu"
LAST_PROGRESS = "megaray_rank_last_progress_timestamp_seconds"
GPU_ALLOCATED = "megaray_rank_gpu_memory_allocated_bytes"
GPU_RESERVED = "megaray_rank_gpu_memory_reserved_bytes"
STRAGGLER_SCORE = "megaray_rank_straggler_score"

RANK_METRICS: dict[str, RankMetric] = {
    m.name: m
    for m in (
        RankMetric(
            STEP_SECONDS,
            "Seconds per step on this rank: the Megatron target's forward step, timed by megaray on every "
            "rank; a program's time between its report() calls, per iteration",
            max,  # a node is as slow as its slowest rank
        ),
        RankMetric(TOKENS_PER_S, "This rank's share of the tokens a second, from report(tokens=...)", sum),
        RankMetric(LOSS, "The loss this rank last reported", statistics.fmean),
        RankMetric(LEARNING_RATE, "The learning rate this rank last reported", max),
        RankMetric(ITERATION, "The iteration this rank last reported", min),
        RankMetric(TFLOPS, "TFLOP/s of this rank's GPU, from report(flops=...) and its step time", min),
        RankMetric(MFU, "Model FLOPs utilisation of this rank's GPU (TFLOP/s over --peak-tflops)", min),
        RankMetric(
            LAST_PROGRESS,
            "Unix time of this rank's last report or timed step (seconds since: time() - it)",
            min,
        ),
        RankMetric(GPU_ALLOCATED, "GPU memory allocated by torch on this rank", max),
        RankMetric(GPU_RESERVED, "GPU memory reserved by torch's caching allocator on this rank", max),
        RankMetric(
            STRAGGLER_SCORE,
            "This rank's time per step against the median of its peers' (1: as fast; named slow from 1.4)",
            max,
        ),
    )
}


@dataclass(frozen=True)
class JobMetric:
    name: str
    description: str
    counter: bool = False
    labels: tuple[str, ...] = JOB_LABELS


JOB_STATE = "megaray_job_state"
JOB_WORLD_SIZE = "megaray_job_world_size"
JOB_NODES = "megaray_job_nodes"
JOB_RESTARTS = "megaray_job_restarts"
JOB_LOST_SECONDS = "megaray_job_lost_seconds"
JOB_FAILURES = "megaray_job_failures"
JOB_ITERATION = "megaray_job_iteration"
JOB_LOSS = "megaray_job_loss"
JOB_STEP_SECONDS = "megaray_job_step_seconds"
JOB_TOKENS_PER_S = "megaray_job_tokens_per_second"
JOB_TFLOPS = "megaray_job_tflops_per_gpu"
JOB_MFU = "megaray_job_mfu"
JOB_LAST_PROGRESS = "megaray_job_last_progress_timestamp_seconds"
JOB_GOODPUT_SECONDS = "megaray_job_goodput_seconds"
JOB_GOODPUT = "megaray_job_goodput_ratio"

JOB_METRICS: dict[str, JobMetric] = {
    m.name: m
    for m in (
        JobMetric(JOB_STATE, "1 for the launch's current state, 0 for the others", labels=(JOB, "state")),
        JobMetric(JOB_WORLD_SIZE, "Ranks of the current attempt"),
        JobMetric(JOB_NODES, "Nodes of the current attempt"),
        JobMetric(JOB_RESTARTS, "Relaunches, by kind (failure, grow)", counter=True, labels=(JOB, "kind")),
        JobMetric(
            JOB_LOST_SECONDS, "Seconds from a relaunch's cause to its ranks running again", counter=True
        ),
        JobMetric(
            JOB_FAILURES, "Failed attempts, by the root cause's kind", counter=True, labels=(JOB, "kind")
        ),
        JobMetric(JOB_ITERATION, "The training's last iteration reported"),
        JobMetric(JOB_LOSS, "The training's last loss reported"),
        JobMetric(JOB_STEP_SECONDS, "Seconds per training iteration"),
        JobMetric(JOB_TOKENS_PER_S, "Tokens a second, every rank together"),
        JobMetric(JOB_TFLOPS, "TFLOP/s per GPU"),
        JobMetric(JOB_MFU, "Model FLOPs utilisation (TFLOP/s per GPU over --peak-tflops)"),
        JobMetric(
            JOB_LAST_PROGRESS, "Unix time of the training's last progress (seconds since: time() - it)"
        ),
        JobMetric(
            JOB_GOODPUT_SECONDS,
            "The launch's seconds so far by where they went (core/goodput.py Cause)",
            labels=(JOB, "cause"),
        ),
        JobMetric(JOB_GOODPUT, "The share of the launch's time so far that trained the model"),
    )
}


def coordinates(rank: int, world_size: int, dims: ParallelDims) -> dict[str, str]:
    """A rank's TP, PP and DP coordinates in Megatron's default order (tp-cp-ep-dp-pp: tensor parallel
    fastest, pipeline stage slowest); empty where the sizes do not divide the world."""
    tp, cp, dp = dims.tp, dims.cp, dims.dp(world_size)
    if dp is None:
        return {"tp": "", "pp": "", "dp": ""}
    return {"tp": str(rank % tp), "dp": str(rank // (tp * cp) % dp), "pp": str(rank // (tp * cp * dp))}


class RankTrack:
    """One rank's figures, as each export takes them (`window()`, every KEEP_EVERY_S): the last
    report's iteration, loss and learning rate; the step time over the reports (or the Megatron
    target's timed steps) since the previous export, so a report costs a few assignments however
    often a rank sends one. `world_size` shares tokens and FLOPs out per rank, `peak_tflops` is MFU's
    denominator."""

    def __init__(self, world_size: int, peak_tflops: float):
        self.world_size, self.peak = max(world_size, 1), peak_tflops
        self.values: dict[str, float] = {}  # the last known of each figure: what is exported
        self.last: tuple[int, float] | None = None  # the last report's (iteration, time)
        self.mark: tuple[int, float] | None = None  # the last report's at the previous window's end
        self.per_iteration: dict[str, float] = {}  # tokens and FLOPs of one iteration, as reported
        self.steps, self.seconds = 0, 0.0  # forward steps timed in this window, and their time

    def report(self, record: dict[str, Any]) -> None:
        it, at = int(record["iteration"]), float(record["time"])
        self.values[ITERATION], self.values[LAST_PROGRESS] = float(it), at
        for key, name in (("loss", LOSS), ("lr", LEARNING_RATE)):
            if isinstance(record.get(key), int | float):
                self.values[name] = float(record[key])
        for key in ("tokens", "flops"):
            if isinstance(record.get(key), int | float):
                self.per_iteration[key] = float(record[key])
        if self.mark is None or it < self.mark[0]:  # the first report, or a resume from a checkpoint
            self.mark = (it, at)
        self.last = (it, at)

    def sample(self, sample: Sample, at: float) -> None:
        """A straggler sample (core/straggler.py) received at `at`: the Megatron target's timed
        forward steps, and GPU memory where the rank uses CUDA."""
        if isinstance(sample, StepSample) and sample.steps:
            self.steps += sample.steps
            self.seconds += sample.seconds
            self.values[LAST_PROGRESS] = at
        if sample.memory is not None:
            self.values[GPU_ALLOCATED], self.values[GPU_RESERVED] = map(float, sample.memory)

    def window(self) -> dict[str, float]:
        """The figures now, the step time over what arrived since the last call (kept when nothing
        did: the rank's last step time until it steps again)."""
        if self.steps:
            self.values[STEP_SECONDS] = self.seconds / self.steps
            self.steps, self.seconds = 0, 0.0
        elif self.last is not None and self.mark is not None and self.last[0] > self.mark[0]:
            step = (self.last[1] - self.mark[1]) / (self.last[0] - self.mark[0])
            self.mark = self.last
            if step > 0:
                self.values[STEP_SECONDS] = step
                if "tokens" in self.per_iteration:
                    self.values[TOKENS_PER_S] = self.per_iteration["tokens"] / self.world_size / step
                if "flops" in self.per_iteration:
                    self.values[TFLOPS] = tflops_per_gpu(self.per_iteration["flops"], step, self.world_size)
                    self.values[MFU] = self.values[TFLOPS] / self.peak
        return self.values


def node_values(by_rank: dict[int, dict[str, float]]) -> dict[str, float]:
    """`--metrics node`: each metric over the node's ranks that have it, by its `aggregate`."""
    names = {name for values in by_rank.values() for name in values}
    return {
        name: RANK_METRICS[name].aggregate([v[name] for v in by_rank.values() if name in v])
        for name in sorted(names)
    }


def series_count(world_size: int, nodes: int, mode: MetricsMode) -> int:
    """Prometheus series megaray adds for one job, at most: every per-rank metric for each rank (or
    node), the job's state for each state, and the rest of the job's (failures and restarts by kind)."""
    if mode is MetricsMode.OFF:
        return 0
    per = world_size if mode is MetricsMode.RANK else nodes
    by_kind = {
        JOB_STATE: len(LaunchState), JOB_FAILURES: len(FailureKind), JOB_RESTARTS: len(RestartKind),
        JOB_GOODPUT_SECONDS: len(Cause),
    }  # fmt: skip
    return per * len(RANK_METRICS) + sum(by_kind.get(name, 1) for name in JOB_METRICS)


@dataclass(frozen=True)
class RankLabels:
    """What a node's forwarder records its ranks' metrics with: the job, `--metrics`, what shares
    tokens and FLOPs per rank, and each of its ranks' labels (node, TP/PP/DP coordinates)."""

    job: str
    mode: MetricsMode
    world_size: int
    peak_tflops: float
    ranks: dict[int, dict[str, str]]

    def tags(self, rank: int) -> dict[str, str]:
        """A series' labels: under --metrics node, the node's (no rank, no coordinates)."""
        mine = self.ranks[rank]
        if self.mode is MetricsMode.NODE:
            return {JOB: self.job, "node": mine["node"], "rank": "", "tp": "", "pp": "", "dp": ""}
        return {JOB: self.job, "rank": str(rank), **mine}


def rank_labels(
    job: str, mode: MetricsMode, where: list[tuple[str, str]], dims: ParallelDims | None,
    peak_tflops: float,
) -> dict[str, RankLabels]:  # fmt: skip
    """Each node's RankLabels, by node id: `where[r]` is rank r's (node id, node label: its IP);
    `dims` are the target's TP, PP and CP where it knows them."""
    world = len(where)
    out: dict[str, dict[int, dict[str, str]]] = {}
    for rank, (node_id, node) in enumerate(where):
        at = coordinates(rank, world, dims) if dims else {"tp": "", "pp": "", "dp": ""}
        out.setdefault(node_id, {})[rank] = {"node": node, **at}
    return {node_id: RankLabels(job, mode, world, peak_tflops, ranks) for node_id, ranks in out.items()}
