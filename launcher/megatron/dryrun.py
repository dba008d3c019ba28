"""The dry-run target: proves the env contract and the rendezvous work, with gloo, on any machine.

Each rank joins the process group from the env the launcher set (init_method env://), all-reduces,
compares every rank's view of the world, and meets at a barrier. A wrong contract fails here with
a message that names the variable, before any GPU job would have hung. Where megatron-core is
installed, the ranks then train a tiny Megatron GPT together (see tiny_gpt.py).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from ..core.target import dry_run_trains, parse_dry_run_options
from .compat import installed


def check_and_train(*args: str) -> dict[str, Any]:
    """One process group for the check and the training: a second init_process_group on the same
    MASTER_PORT can read the first group's addresses from the store (its keys restart at the same
    names) and connect to a rank's closed socket (gloo's "Broken pipe")."""
    import torch.distributed as dist

    options = parse_dry_run_options(args)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        result = check()
        if dry_run_trains(args) and installed("megatron.core"):
            from .tiny_gpt import train

            result["training"] = train(**options)
        else:
            result["training"] = None
        return result
    finally:
        dist.destroy_process_group()


def check() -> dict[str, Any]:
    """Runs in the caller's process group (env:// init), which it leaves open."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if dist.get_rank() != rank or dist.get_world_size() != world:
        raise RuntimeError(
            f"process group says rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"env says RANK={rank} WORLD_SIZE={world}"
        )
    total = torch.ones(1)
    dist.all_reduce(total)
    if int(total.item()) != world:
        raise RuntimeError(f"all-reduce of ones gave {total.item()}, expected {world}")
    mine = {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "node_rank": int(os.environ["GROUP_RANK"]),
        "host": socket.gethostname(),
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }
    views: list[dict[str, Any]] = [{} for _ in range(world)]
    dist.all_gather_object(views, mine)
    _check_views(views)
    dist.barrier()
    return {**mine, "all_reduce": int(total.item())}


def _check_views(views: list[dict[str, Any]]) -> None:
    """Every rank must agree on the world, the master, and hold a LOCAL_RANK unique on its node."""
    for key in ("world_size", "master"):
        seen = {v[key] for v in views}
        if len(seen) != 1:
            raise RuntimeError(f"ranks disagree on {key}: {sorted(map(str, seen))}")
    if sorted(v["rank"] for v in views) != list(range(len(views))):
        raise RuntimeError(f"ranks are not 0..{len(views) - 1}: {[v['rank'] for v in views]}")
    per_node: dict[int, list[int]] = {}
    for v in views:
        per_node.setdefault(v["node_rank"], []).append(v["local_rank"])
    for node, locals_ in per_node.items():
        if sorted(locals_) != list(range(len(locals_))):
            raise RuntimeError(
                f"node {node} has LOCAL_RANK values {sorted(locals_)}, expected 0..{len(locals_) - 1}"
            )
