"""`megaray up`, `megaray down`: a local Ray that launches attach to, started once (driver/cluster/up.py),
and warm pools on it or on a cluster (driver/cluster/pool.py); `megaray list` shows them (`show_pools`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from collections.abc import Iterator

from ..core.args import ArgumentParser, number
from ..core.errors import Interrupted, MegarayError, UsageError
from ..core.topology import local_ranks_problem

log = logging.getLogger("megaray")

WHAT = {
    "up": "start a local Ray that launches attach to, holding one started process per rank for the next "
    "launch; with --warm, with torch imported (there, or on the cluster at --address)",
    "down": "stop the local Ray of `megaray up`; with --address, give back that cluster's warm pool",
}


def build_parser(command: str) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=f"megaray {command}", description=WHAT[command])
    p.add_argument("--address", help="a running Ray cluster (HOST:PORT of its GCS; for down, default "
                   "RAY_ADDRESS)")  # fmt: skip
    if command == "up":
        p.add_argument("--nodes", type=int, default=1, help="nodes (simulated without --address; default 1)")
        p.add_argument("--gpus-per-node", "--nproc-per-node", dest="gpus_per_node", type=int, default=2,
                       help="ranks per node (default 2)")  # fmt: skip
        p.add_argument("--device", choices=("cpu", "gpu"), default=None,
                       help="cpu (default here) or gpu (default with --address)")  # fmt: skip
        p.add_argument("--cpus-per-rank", type=number, default=1.0, help="CPUs reserved per rank (default 1)")
        p.add_argument(
            "--warm",
            action="store_true",
            help="keep a warm pool: one process per rank with torch imported, taken by the next launch of "
            "this layout and refilled after it",
        )
        p.add_argument(
            "--recipe",
            help="with --warm: the pool also imports Megatron-Bridge and this recipe's module (no CUDA "
            "context made), and a launch that takes it builds the preflight's config there, in a second",
        )
        p.add_argument(
            "--idle-timeout",
            type=number,
            default=1800.0,
            help="seconds an unclaimed pool holds its bundles, then gives them back (default 1800; 0: "
            "until `megaray down`)",
        )
    return p


def main(command: str, argv: list[str], exits_after: bool = False) -> int:
    from ..driver.cluster import up

    args = build_parser(command).parse_args(argv)
    if command == "up":
        return _up(args, exits_after)
    address = args.address or os.environ.get("RAY_ADDRESS")
    standing = up.running()
    if address or standing is not None:  # imports Ray (0.3 s): not for "no `megaray up` is running"
        from ..driver.cluster import pool
    if address:  # down --address: the cluster's pool
        with _connected(address, exits_after):
            layout = pool.drop()
        if layout is None:
            log.info("no warm pool at %s", address)
        else:
            log.info("gave back the warm pool of %s at %s", layout.describe(), address)
        return 0
    if standing is None:
        log.info("no `megaray up` is running")
        return 0
    ending: list[str] = []
    up.mark_stopping(standing)
    try:
        # disconnected before the nodes stop (not left to the process's exit): Ray's error listener
        # thread in a driver whose GCS went away spins on a core until the process ends (6 s of CPU,
        # and `down` 3x slower, on 2 cores)
        with _connected(standing.address, exits_after=False):
            ending = up.launches_on_it()
            pool.drop()  # its detached processes would hold up the node's own stop for 30 s
    except MegarayError as e:  # the nodes are stopped all the same
        log.warning("could not give the warm pool back first (%s); stopping the nodes", e)
    if ending:  # #46: they failed later, blaming a crash or the OOM killer
        log.warning("stopping it ends %d launch(es) running on it: %s", len(ending), "; ".join(ending))
    left = up.stop(standing)
    killed = f" (killed {len(left)} process(es) that did not stop on SIGTERM)" if left else ""
    log.info("stopped the local Ray at %s%s", standing.describe(), killed)
    return 0


def _up(args: argparse.Namespace, exits_after: bool) -> int:
    from ..driver.cluster import up
    from ..driver.cluster.pool import PoolLayout, keep

    device = args.device or ("gpu" if args.address else "cpu")
    layout = PoolLayout(
        args.nodes, args.gpus_per_node, device, args.cpus_per_rank, args.idle_timeout,
        fixed_size=not args.address, warm=args.warm, recipe=args.recipe,
    )  # fmt: skip
    if args.address:
        if not args.warm:
            raise UsageError(
                "the cluster at --address is already up: `megaray up --address` keeps a warm pool "
                "there, add --warm (or launch with --address directly)"
            )
        with _connected(args.address, exits_after):
            log.info("placing a %s of %s there, %s (seconds)", layout.kind, layout.describe(), layout.holds)
            keep(layout)
        log.info(
            "a warm pool of %s is ready at %s for launches with --address %s (`megaray down --address` "
            "gives it back; unclaimed, it does after %.0f s)",
            layout.describe(), args.address, args.address, args.idle_timeout,
        )  # fmt: skip
        return 0
    if device == "cpu" and (
        problem := local_ranks_problem(args.nodes * args.gpus_per_node, os.cpu_count() or 1)
    ):
        raise UsageError(problem)
    if device == "gpu" and args.nodes > 1:
        raise UsageError(
            "simulated nodes hold CPU ranks: use --device cpu, or --nodes 1 for this machine's GPUs"
        )
    with up.one_at_a_time():
        standing = up.running()
        if standing is not None:
            log.info("`megaray up` is already running at %s; `megaray down` stops it", standing.describe())
            return 0
        # about 10-20 s on a small machine: said first, so that a silent terminal is not taken for a hang
        starting = (
            f"starting a local Ray of {layout.describe()}, then its {layout.kind} (one process per rank, "
            f"{layout.holds})..."
        )
        try:
            standing = up.start(
                args.nodes, args.gpus_per_node, device, args.cpus_per_rank, lambda: keep(layout), starting
            )
        except Interrupted as e:
            log.error("interrupted by %s: stopped the nodes started so far; nothing is left running", e.name)
            return e.exit_code
    log.info(
        "started a local Ray at %s, with a %s (one process per rank, %s); launches without --address or "
        "RAY_ADDRESS use it until `megaray down`",
        standing.describe(), layout.kind, layout.holds,
    )  # fmt: skip
    return 0


def show_pools(address: str | None, exits_after: bool = False) -> bool:
    """For `megaray list`: the `megaray up` Ray and the warm pool of the cluster at `address` (a GCS
    HOST:PORT), or of `megaray up`'s Ray. Whether a `megaray up` is running."""
    from ..driver.cluster import up

    standing = up.running()
    if standing is not None:
        age = time.time() - standing.started_at
        print(f"megaray up: {standing.describe()}, up {int(age // 60)} min, temp dir {standing.temp_dir}")
    where = address or (standing.address if standing else None)
    if where is None:
        return False
    from ..driver.cluster import pool  # imports Ray (0.3 s): not for "nothing runs here"

    with _connected(where, exits_after):
        layout = pool.recorded()
        if layout is None:
            print(f"pool at {where}: none (`megaray up` keeps one; `megaray up --warm`, with torch imported)")
        else:
            idle = f"gives its bundles back after {layout.idle_timeout_s:.0f} s unclaimed" if (
                layout.idle_timeout_s) else "kept until `megaray down`"  # fmt: skip
            print(f"{layout.kind} at {where}: {layout.describe()}, {pool.state(layout)}; {idle}")
    return standing is not None


@contextlib.contextmanager
def _connected(address: str, exits_after: bool = False) -> Iterator[None]:
    """Connected to the cluster at `address` as a launch connects (token auth, clear errors)."""
    from ..core.spec import LaunchSpec
    from ..core.target import DRY_RUN_TARGET
    from ..driver.cluster.cluster import connect

    probe = LaunchSpec(nodes=1, gpus_per_node=1, target=DRY_RUN_TARGET, dry_run=True, address=address,
                       job_name="megaray-pool")  # fmt: skip
    with connect(probe, exits_after=exits_after):
        yield
