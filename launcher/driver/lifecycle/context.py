"""What every attempt of one launch shares, made once by driver/lifecycle/launch.py and handed to each attempt
(driver/lifecycle/attempt.py), instead of a closure over the launch's locals and a constructor per piece."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...core.elastic import ScalingPolicy
from ...core.layout import ParallelDims
from ...core.spec import LaunchSpec
from ...core.target import Target
from ..cluster.cluster import Cluster
from ..output.metrics import JobMetrics
from ..output.progress_view import ProgressView
from ..output.rundir import RunDir
from .stop import StopSignal


@dataclass
class LaunchContext:
    """The launch's spec, cluster, EFA/NCCL profile, stop signal, run directory, progress view and
    metrics; its scaling policy (core/elastic.py); and the target's TP, PP and CP at a given size,
    for the ranks' metric labels. The nodes found lost travel with the controller's states
    (`Placing.avoid`), not here."""

    spec: LaunchSpec
    cluster: Cluster
    profile: dict[str, str]
    stop: StopSignal
    run: RunDir
    progress: ProgressView
    metrics: JobMetrics
    scaling: ScalingPolicy
    parallel_dims: Callable[[LaunchSpec], ParallelDims | None] = lambda spec: None


@dataclass(frozen=True)
class AttemptTarget:
    """The program one attempt runs: `known` up front (a relaunch resuming from the first attempt's
    checkpoints), or asked for once its ranks are started (`later(gpu_gib, ready)`: the first
    attempt's, once the preflight's verdict is in, given the smallest placed GPU's memory and rank
    0's process with the call after which its stack is imported), its ranks importing the target's
    stack meanwhile when `imports_first`. Neither: the spec's."""

    known: Target | None = None
    later: Callable[[float | None, Any], Target] | None = None
    imports_first: bool = False
