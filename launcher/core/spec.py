"""The launch request: one frozen `LaunchSpec`, built from the command line by `spec_from_args`.

Everything after parsing receives the same spec unchanged, so what was asked is what is recorded
and what is run. Values are checked in `__post_init__`, whose messages print the numbers.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from .args import ArgumentParser, number
from .elastic import NodeRange, parse_nodes
from .errors import UsageError
from .metrics import MetricsMode
from .progress import H100_SXM_BF16_TFLOPS
from .rankenv import parse_env_pairs
from .recipes import check_overrides, load_recipe
from .shellenv import forwarded_env
from .target import DRY_RUN_TARGET, Target, TargetKind, parse_dry_run_options
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
        if self.grow_after_s is not None and not self.grow_after_s > 0:
            raise ValueError(f"--grow-after must be above 0 seconds, got {self.grow_after_s}")
        if self.grow_after_s is not None and not self.node_range.elastic:
            raise ValueError("--grow-after grows a job of --nodes MIN:MAX: give a range, or drop it")
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


def build_parser(epilog: str | None = None) -> argparse.ArgumentParser:
    """The launch's options. `epilog`: what `megaray --help` lists after them (the subcommands, from
    cli/commands.py; core does not import the command line)."""
    p = ArgumentParser(
        prog="megaray",
        description="Launch a torchrun-style program on a Ray cluster: one placement group per node,\n"
        "one actor per rank, the torchrun env contract in each.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nodes",
        default="1",
        metavar="N|MIN:MAX",
        help="number of nodes (one placement group each); MIN:MAX runs on as many as the cluster holds, "
        "at least MIN, and goes on with fewer when a node is lost",
    )
    p.add_argument(
        "--gpus-per-node",
        "--nproc-per-node",
        dest="gpus_per_node",
        type=int,
        default=1,
        help="ranks per node; each rank gets one GPU (or one CPU bundle with --device cpu)",
    )
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="gpu (default) or cpu bundles")
    p.add_argument(
        "--cpus-per-rank", type=number, default=1.0, help="CPUs reserved per rank in its bundle (default 1)"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run a gloo init/all-reduce/barrier check on every rank instead of a program, then (where "
        "megatron-core is installed) a tiny Megatron GPT; its options go after it: steps=N (default 20; 0: "
        "the check alone), save=DIR, save_every=N, data=PREFIX (a Megatron indexed dataset), tp=N, pp=N, "
        "global_batch=N; with no cluster address, the nodes are simulated on this machine",
    )
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--job-name", help="name for the placement groups and actors (default: generated)")
    p.add_argument(
        "--placement-timeout",
        type=number,
        default=DEFAULT_PLACEMENT_TIMEOUT_S,
        help=f"seconds to wait for the cluster to fit the layout (default {DEFAULT_PLACEMENT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--master-port", type=int, help="rendezvous port (default: a free port on the master node)"
    )
    p.add_argument("--env-profile", help="network/NCCL env profile: a name under env/ or a YAML path")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="set a variable in every rank; KEY alone forwards this shell's value",
    )
    p.add_argument("--entrypoint", metavar="PKG.MODULE:FUNCTION", help="call this function on every rank")
    p.add_argument(
        "-m", "--module", nargs=argparse.REMAINDER, metavar="MODULE ...",
        help="run a module as `python -m MODULE` on every rank: what follows it is the module's (its "
        "options too), as under python and torchrun",
    )  # fmt: skip
    p.add_argument(
        "--recipe",
        help="run Megatron-Bridge with this recipe: a name under recipes/, a YAML path, or one of bridge's "
        "own recipe functions by name or as module:function (`megaray recipes` lists them); trailing "
        "key=value arguments override it",
    )
    p.add_argument("--hf-path", help="HF model id or local folder to read the model config from")
    p.add_argument(
        "--check", action="store_true", help="build the recipe's config here and check its layout, then exit"
    )
    p.add_argument(
        "--gpu-memory-gb",
        type=number,
        default=None,
        help="GiB of memory per GPU: a recipe whose estimate at the first step is larger is refused "
        "before it trains (default: the placed GPUs' own, from NVML; with --check, "
        f"{DEFAULT_GPU_MEMORY_GB:g}: H100/A100 80GB)",
    )
    p.add_argument(
        "--log-ranks",
        default="0",
        metavar="all|0,3,8-11",
        help="ranks whose output the console shows, prefixed [r<rank> n<node>] (default 0); every rank's "
        "output goes to <runs-dir>/<job>/rank-<r>.log",
    )
    p.add_argument("--runs-dir", default="runs", help="where run directories go (default ./runs)")
    p.add_argument(
        "--peak-tflops",
        type=number,
        default=H100_SXM_BF16_TFLOPS,
        help=f"peak TFLOP/s per GPU for MFU (default {H100_SXM_BF16_TFLOPS:g}: H100 SXM, dense BF16)",
    )
    p.add_argument(
        "--metrics",
        choices=[m.value for m in MetricsMode],
        default=MetricsMode.RANK.value,
        help="training metrics in Ray's Prometheus export (ray_megaray_*): a series per rank (default), "
        "per node (its ranks aggregated: for thousands of ranks), or off",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="after a rank or node failure or a hang, relaunch the whole group up to N times (Megatron "
        "recipes resume from their last checkpoint)",
    )
    p.add_argument(
        "--grow-after",
        type=number,
        default=None,
        metavar="S",
        help="with --nodes MIN:MAX, running below MAX: relaunch on more nodes S seconds after the cluster "
        "has room for them (Megatron targets grow at their next checkpoint without it)",
    )
    p.add_argument(
        "--hang-timeout",
        type=number,
        default=DEFAULT_HANG_TIMEOUT_S,
        help=f"seconds without output or progress from any rank before the job counts as hung; its stacks "
        f"are printed (default {DEFAULT_HANG_TIMEOUT_S:g}; 0 turns it off)",
    )
    p.add_argument(
        "--spares",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --max-restarts, keep a warm spare process per rank (torch and Megatron imported, in "
        "the rank's bundle, no resources of its own) so that a restart skips start-up; --no-spares saves "
        "their host memory (default on)",
    )
    p.add_argument(
        "--exit-grace",
        type=number,
        default=DEFAULT_EXIT_GRACE_S,
        help="seconds a rank's process may take to end after the program returned (atexit handlers, "
        f"non-daemon threads), then it is killed (default {DEFAULT_EXIT_GRACE_S:g})",
    )
    p.add_argument(
        "--kill-grace",
        type=number,
        default=DEFAULT_KILL_GRACE_S,
        help="after a rank failed or the launch was stopped, seconds between SIGTERM to the other ranks "
        f"and killing them (default {DEFAULT_KILL_GRACE_S:g})",
    )
    p.add_argument("target", nargs="?", help="script to run on every rank, as torchrun runs it")
    p.add_argument("target_args", nargs=argparse.REMAINDER, help="arguments for the script or function")
    return p


def spec_from_args(
    argv: list[str],
    environ: Mapping[str, str] | None = None,
    cwd: str | None = None,
    help_epilog: str | None = None,
) -> LaunchSpec:
    """Parse the command line into a LaunchSpec; bad input raises UsageError (exit 2)."""
    environ = os.environ if environ is None else environ
    args = build_parser(help_epilog).parse_args(argv)
    if args.module is not None:  # `-m MODULE ARGS...`: ARGS are the module's, as python reads them
        if not args.module or args.module[0].startswith("-"):
            raise UsageError("-m needs a module name: megaray [options] -m pkg.train [its arguments]")
        args.module, module_args = args.module[0], args.module[1:]
        args.target_args = [*module_args, *(args.target_args or [])]
    given = [
        f for f, v in (("--entrypoint", args.entrypoint), ("-m", args.module), ("--recipe", args.recipe)) if v
    ]
    if len(given) > 1:
        raise UsageError(f"give one target: {' or '.join(given)}, not several")
    try:
        if args.dry_run and not given and all("=" in a for a in _script_args(args)):
            options = tuple(_script_args(args))
            parse_dry_run_options(options)
            target = Target(DRY_RUN_TARGET.kind, DRY_RUN_TARGET.name, options)
        elif args.recipe:
            overrides = _script_args(args)
            check_overrides(overrides)
            target = Target(
                TargetKind.MEGATRON, args.recipe, tuple(overrides), load_recipe(args.recipe), args.hf_path
            )
        elif args.entrypoint:
            target = Target(TargetKind.ENTRYPOINT, args.entrypoint, tuple(_script_args(args)))
        elif args.module:
            target = Target(TargetKind.MODULE, args.module, tuple(_script_args(args)))
        elif args.target:
            target = Target(TargetKind.SCRIPT, args.target, tuple(args.target_args))
        else:
            raise UsageError(
                "nothing to run: give --recipe NAME, a script, --entrypoint pkg.module:function, -m module, "
                "or --dry-run"
            )
        env = parse_env_pairs(args.env, environ)
        nodes = parse_nodes(args.nodes)
        return LaunchSpec(
            nodes=nodes.max,
            min_nodes=nodes.min if nodes.elastic else None,
            grow_after_s=args.grow_after,
            gpus_per_node=args.gpus_per_node,
            target=target,
            device=args.device,
            dry_run=args.dry_run,
            cpus_per_rank=args.cpus_per_rank,
            address=args.address or environ.get("RAY_ADDRESS") or None,
            job_name=args.job_name or default_job_name(),
            placement_timeout_s=args.placement_timeout,
            master_port=args.master_port,
            env_profile=args.env_profile,
            env=tuple(env.items()),
            forwarded=tuple(forwarded_env(environ).items()),
            cwd=cwd or os.getcwd(),
            check_only=args.check,
            gpu_memory_gb=args.gpu_memory_gb,
            log_ranks=args.log_ranks,
            runs_dir=args.runs_dir,
            peak_tflops=args.peak_tflops,
            metrics=MetricsMode(args.metrics),
            max_restarts=args.max_restarts,
            hang_timeout_s=args.hang_timeout,
            spares=args.spares,
            exit_grace_s=args.exit_grace,
            kill_grace_s=args.kill_grace,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _script_args(args: argparse.Namespace) -> list[str]:
    """With --entrypoint or -m, everything positional is the function's or module's arguments."""
    rest = ([args.target] if args.target else []) + list(args.target_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    return rest
