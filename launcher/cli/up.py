"""`megaray up` and `megaray down`: a local Ray that launches attach to, started once (driver/up.py)."""

from __future__ import annotations

import argparse
import logging

from ..core.args import ArgumentParser
from ..core.errors import UsageError

log = logging.getLogger("megaray")


def build_parser(command: str) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=f"megaray {command}", description=__doc__.splitlines()[0])
    if command == "up":
        p.add_argument("--nodes", type=int, default=1, help="simulated nodes (default 1)")
        p.add_argument("--gpus-per-node", "--nproc-per-node", dest="gpus_per_node", type=int, default=2,
                       help="ranks per node (default 2)")  # fmt: skip
        p.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="cpu (default): CPU ranks")
        p.add_argument("--cpus-per-rank", type=float, default=1.0)
        p.add_argument(
            "--warm",
            action="store_true",
            help="keep a warm pool: one process per rank with torch imported, taken by the next launch of "
            "this layout and refilled after it",
        )
        p.add_argument(
            "--idle-timeout",
            type=float,
            default=1800.0,
            help="seconds an unclaimed warm pool holds its bundles, then gives them back (default 1800)",
        )
    return p


def main(command: str, argv: list[str]) -> int:
    from ..driver import up

    args = build_parser(command).parse_args(argv)
    standing = up.running()
    if command == "down":
        if standing is None:
            log.info("no `megaray up` is running")
            return 0
        left = up.stop(standing)
        killed = f" (killed {len(left)} process(es) that did not stop on SIGTERM)" if left else ""
        log.info("stopped the local Ray at %s%s", standing.describe(), killed)
        return 0
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if args.device == "gpu" and args.nodes > 1:
        raise UsageError(
            "simulated nodes hold CPU ranks: use --device cpu, or --nodes 1 for this machine's GPUs"
        )
    if standing is not None:
        log.info("`megaray up` is already running at %s; `megaray down` stops it", standing.describe())
        return 0
    from ..driver.pool import fill

    standing = up.start(
        args.nodes, args.gpus_per_node, args.device, args.cpus_per_rank, args.warm, args.idle_timeout,
        fill_pool=(lambda s: fill(s, wait=True)) if args.warm else None,
    )  # fmt: skip
    log.info(
        "started a local Ray at %s; launches without --address or RAY_ADDRESS use it until `megaray down`",
        standing.describe(),
    )
    return 0
