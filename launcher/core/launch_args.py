"""The launch's command line: its options (`build_parser`) and the one pure function that turns argv
into the frozen `LaunchSpec` (core/spec.py) every later part receives unchanged."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from .args import ArgumentParser, number
from .elastic import parse_nodes
from .errors import UsageError
from .metrics import MetricsMode
from .progress import H100_SXM_BF16_TFLOPS
from .rankenv import parse_env_pairs
from .recipes import check_overrides, load_recipe
from .shellenv import forwarded_env
from .spec import (
    DEFAULT_EXIT_GRACE_S,
    DEFAULT_GPU_MEMORY_GB,
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_KILL_GRACE_S,
    DEFAULT_PLACEMENT_TIMEOUT_S,
    LaunchSpec,
    default_job_name,
)
from .target import DRY_RUN_TARGET, Target, TargetKind, parse_dry_run_options


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
        "global_batch=N, exit_signal_handler=true (SIGTERM: a checkpoint, then exit 0, as "
        "Megatron-Bridge's); with no cluster address, the nodes are simulated on this machine",
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
        "--evict-stragglers",
        type=number,
        default=None,
        metavar="S",
        help="with --nodes MIN:MAX: a node whose rank stays named slow for S seconds is dropped at the "
        "target's next checkpoint (a plain program: with --grow-after), the job relaunched without it",
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
        ranged = (
            ("--grow-after", args.grow_after, "grows"),
            ("--evict-stragglers", args.evict_stragglers, "drops a node of"),
        )
        for flag, value, does in ranged:
            if value is not None and not nodes.elastic:  # not LaunchSpec's: an attempt runs on N of them
                raise UsageError(f"{flag} {does} a job of --nodes MIN:MAX: give a range, or drop it")
        return LaunchSpec(
            nodes=nodes.max,
            min_nodes=nodes.min if nodes.elastic else None,
            grow_after_s=args.grow_after,
            evict_after_s=args.evict_stragglers,
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
