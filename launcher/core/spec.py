"""The launch request: one frozen `LaunchSpec`, built from the command line by `spec_from_args`
(core/launch_args.py).

Everything after parsing receives the same spec unchanged, so what was asked is what is recorded
and what is run. Values are checked in `__post_init__`, whose messages print the numbers.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .elastic import NodeRange
from .metrics import MetricsMode
from .progress import H100_SXM_BF16_TFLOPS
from .target import Target, TargetKind
from .topology import parse_rank_list

DEFAULT_PLACEMENT_TIMEOUT_S = 120.0
# Well under NCCL's 10-minute collective timeout, so a hang is reported (with stacks) by megaray
# first; long enough for checkpoint saves and data-index builds that print nothing.
DEFAULT_HANG_TIMEOUT_S = 300.0
# After the program returns, its process ends as Python's do (atexit handlers, non-daemon threads):
# long enough for trackers to flush and uploads to finish.
DEFAULT_EXIT_GRACE_S = 60.0
# After a failure or a stop, surviving ranks get SIGTERM, then are killed after this (torchrun: 30 s).
DEFAULT_KILL_GRACE_S = 5.0
RAY_NAMESPACE = "megaray"  # megaray's named actors and placement groups live here
DEFAULT_GPU_MEMORY_GB = 80.0  # H100 / A100 80GB, what bridge's recipes are written for
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")


@dataclass(frozen=True)
class LaunchSpec:
    nodes: int  # the most nodes (`--nodes N` or the MAX of `--nodes MIN:MAX`): what a launch asks for
    gpus_per_node: int
    target: Target
    device: str = "gpu"  # "gpu": one GPU bundle per rank; "cpu": CPU bundles only
    dry_run: bool = False
    cpus_per_rank: float = 1.0
    address: str | None = None  # None: RAY_ADDRESS, else a local Ray (simulated nodes for --dry-run)
    job_name: str = ""
    placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S
    master_port: int | None = None
    env_profile: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    forwarded: tuple[tuple[str, str], ...] = ()  # the launching shell's variables (core/shellenv.py)
    cwd: str = field(default_factory=os.getcwd)
    check_only: bool = False  # --check: validate the Megatron layout in the driver, then exit
    log_ranks: str = "0"  # ranks whose output the console shows ("all", or "0,3,8-11")
    runs_dir: str = "runs"  # run directories go to <runs_dir>/<job_name>, relative to cwd
    peak_tflops: float = H100_SXM_BF16_TFLOPS  # per GPU, the denominator of MFU
    max_restarts: int = 0  # relaunches of the whole group after a failure, as torchrun --max-restarts
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S  # no rank output or progress this long: a hang; 0: off
    spares: bool = True  # with restarts left, warm spare actors wait in the bundles (spares.py)
    exit_grace_s: float = DEFAULT_EXIT_GRACE_S  # a returned rank's process may finish its exit this long
    kill_grace_s: float = DEFAULT_KILL_GRACE_S  # SIGTERM, then this long before the kill
    # per GPU, what the memory preflight checks against; None: the placed GPUs' own (NVML), and
    # DEFAULT_GPU_MEMORY_GB for `--check`, which places nothing
    gpu_memory_gb: float | None = None
    min_nodes: int | None = None  # `--nodes MIN:MAX`: the fewest an attempt runs on (None: `nodes`)
    grow_after_s: float | None = None  # below MAX nodes with room for more: relaunch on them after this
    evict_after_s: float | None = None  # a rank named slow this long: its node dropped (core/elastic.py)
    metrics: MetricsMode = MetricsMode.RANK  # Prometheus series through Ray's export (core/metrics.py)

    def __post_init__(self):
        for flag, value in (
            ("--cpus-per-rank", self.cpus_per_rank), ("--placement-timeout", self.placement_timeout_s),
            ("--hang-timeout", self.hang_timeout_s), ("--exit-grace", self.exit_grace_s),
            ("--kill-grace", self.kill_grace_s), ("--gpu-memory-gb", self.gpu_memory_gb),
            ("--peak-tflops", self.peak_tflops),
        ):  # fmt: skip
            if value is not None and not math.isfinite(value):  # nan passes every comparison below
                raise ValueError(f"{flag} must be a finite number, got {value}")
        self.node_range  # noqa: B018 (checks MIN and MAX, with the numbers)
        if self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node}")
        if self.device not in ("gpu", "cpu"):
            raise ValueError(f"--device must be gpu or cpu, got {self.device!r}")
        if self.cpus_per_rank < 0 or (self.device == "cpu" and self.cpus_per_rank == 0):
            raise ValueError(
                f"--cpus-per-rank must be {'above' if self.device == 'cpu' else 'at least'} 0 "
                f"with --device {self.device}, got {self.cpus_per_rank}"
            )
        if self.placement_timeout_s <= 0:
            raise ValueError(f"--placement-timeout must be above 0 seconds, got {self.placement_timeout_s}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port must be within 1-65535, got {self.master_port}")
        if not _JOB_NAME.match(self.job_name):
            raise ValueError(
                f"--job-name {self.job_name!r} must be 1-63 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        if self.check_only and self.target.kind is not TargetKind.MEGATRON:
            raise ValueError("--check validates a Megatron layout: give it with --recipe")
        parse_rank_list(self.log_ranks, self.world_size)
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.hang_timeout_s < 0:
            raise ValueError(f"--hang-timeout must be 0 (off) or more seconds, got {self.hang_timeout_s}")
        for flag, value in (("--exit-grace", self.exit_grace_s), ("--kill-grace", self.kill_grace_s)):
            if value < 0:
                raise ValueError(f"{flag} must be 0 or more seconds, got {value}")
        for flag, value in (("--grow-after", self.grow_after_s), ("--evict-stragglers", self.evict_after_s)):
            if (
                value is not None and not value > 0
            ):  # with a range: spec_from_args (an attempt's spec has none)
                raise ValueError(f"{flag} must be above 0 seconds, got {value}")
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ValueError(f"--gpu-memory-gb must be above 0, got {self.gpu_memory_gb}")
        if self.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be above 0, got {self.peak_tflops}")
        if self.dry_run != (self.target.kind is TargetKind.DRYRUN):
            raise ValueError(
                "--dry-run runs the built-in check: drop the script or --entrypoint, or --dry-run"
            )

    def at_nodes(self, nodes: int) -> LaunchSpec:
        """This launch on `nodes` nodes, as an attempt of `--nodes MIN:MAX` runs: the console shows the
        ranks asked for that it has (rank 0 when none)."""
        world = nodes * self.gpus_per_node
        if self.log_ranks.strip().lower() == "all":
            return replace(self, nodes=nodes)
        shown = ",".join(str(r) for r in sorted(self.console_ranks) if r < world)
        return replace(self, nodes=nodes, log_ranks=shown or "0")

    @property
    def node_range(self) -> NodeRange:
        return NodeRange(self.nodes if self.min_nodes is None else self.min_nodes, self.nodes)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def uses_gpus(self) -> bool:
        return self.device == "gpu"

    @property
    def console_ranks(self) -> frozenset[int]:
        return parse_rank_list(self.log_ranks, self.world_size)

    @property
    def run_dir(self) -> Path:
        return Path(self.cwd) / self.runs_dir / self.job_name

    @property
    def env_overrides(self) -> dict[str, str]:
        return dict(self.env)


def default_job_name() -> str:
    return f"megaray-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
