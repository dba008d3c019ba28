"""A warm pool across launches (`megaray up --warm`): one rank process per slot of the `megaray up`
layout, already started by Ray, with torch (and megatron-core where installed) imported and CUDA not
initialised, in placement groups it holds.

Warm spares (spares.py) do this within a job, for a restart; the pool does it for the next launch.
A launch whose layout is the pool's claims it (the first to ask gets it), gives each process its
rank and env as any rank gets them, and runs the program there as torchrun would (`__main__`,
argv, cwd; the program's own modules are imported fresh, since only torch and the launcher's stack
were imported ahead). The processes and groups are detached: they outlive the launch that made them.
After a launch took the pool, the next one is started in the background, for the launch after.
An idle pool gives its bundles (GPUs included) back after `--idle-timeout`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace

import ray

from ..core.spec import LaunchSpec
from ..core.target import DRY_RUN_TARGET
from ..core.topology import RankReport, RankSlot, assign_ranks, order_nodes
from . import placement
from .actors import start_rank_actor, wait_all
from .cluster import NAMESPACE
from .spares import warm_steps
from .supervise import StopSignal
from .up import Standing, running

log = logging.getLogger("megaray")

POOL = "megaray-pool"
POOL_READY_S = 120.0  # a pool still importing (just refilled) is waited for this long, then skipped


def _spec(s: Standing) -> LaunchSpec:
    return LaunchSpec(
        nodes=s.nodes, gpus_per_node=s.gpus_per_node, target=DRY_RUN_TARGET, dry_run=True, device=s.device,
        cpus_per_rank=s.cpus_per_rank, job_name=POOL,
    )  # fmt: skip


def fill(s: Standing, wait: bool) -> None:
    """Place the pool's groups (detached) and start one importing process per bundle."""
    spec = _spec(s)
    groups = placement.place_groups(spec, POOL, StopSignal(), fixed_size=True, detached=True)
    env = {"OMP_NUM_THREADS": "1"} if s.gpus_per_node > 1 else {}  # what ranks get, before torch loads
    imports, idle = warm_steps(DRY_RUN_TARGET), s.idle_timeout_s  # megatron's are skipped if absent
    actors = [
        start_rank_actor(
            f"{POOL}-g{g}b{b}", group, b, job=POOL, rank=g * s.gpus_per_node + b, node_ip="",
            num_cpus=spec.cpus_per_rank, num_gpus=1 if spec.uses_gpus else 0,
            pooled={"env": env, "steps": imports, "group": f"{POOL}-node{g}", "idle_timeout_s": idle},
        )
        for g, group in enumerate(groups)
        for b in range(s.gpus_per_node)
    ]  # fmt: skip
    if wait:
        ray.get([a.info.remote() for a in actors], timeout=POOL_READY_S)


@dataclass(frozen=True)
class Taken:
    groups: list
    slots: list[RankSlot]
    actors: list
    reports: list[RankReport]


def take(spec: LaunchSpec, stop: StopSignal) -> Taken | None:
    """The pool's processes for this launch, in rank order, or None (no pool, another layout, or
    another launch took it): then the launch starts cold."""
    s = running()
    if s is None or not s.warm:
        return None
    if (spec.nodes, spec.gpus_per_node, spec.device) != (s.nodes, s.gpus_per_node, s.device) or (
        spec.cpus_per_rank > s.cpus_per_rank
    ):
        if give_back(s):
            log.info(
                "the warm pool is for %s: given back for this launch's layout, which starts cold",
                s.describe(),
            )
        return None
    groups = _groups(s)
    try:
        by_bundle = {
            (g, b): ray.get_actor(f"{POOL}-g{g}b{b}", namespace=NAMESPACE)
            for g in range(s.nodes)
            for b in range(s.gpus_per_node)
        }
    except ValueError:  # an actor is gone
        by_bundle = None
    if by_bundle is None or len(groups) < s.nodes:
        give_back(s)  # a part of it, if any: this launch needs the room
        log.info("the warm pool is not there (given back when idle, or in use): this launch starts cold")
        return None
    claims = [a.claim.remote(spec.job_name) for a in by_bundle.values()]
    if len(wait_all(claims, POOL_READY_S, stop)) < len(claims) or not all(ray.get(claims)):
        log.info("the warm pool is still starting, or another launch took it: this launch starts cold")
        return None
    slots = assign_ranks(order_nodes(placement.resolve_nodes(groups)), spec.gpus_per_node)
    actors = [by_bundle[(slot.group, slot.bundle)] for slot in slots]
    reports = ray.get([a.info.remote() for a in actors])
    log.info("taking the warm pool of `megaray up` (%d processes with torch imported)", len(actors))
    return Taken(
        groups, slots, actors, [replace(r, rank=sl.rank) for r, sl in zip(reports, slots, strict=True)]
    )


def _groups(s: Standing) -> list:
    """The pool's placement groups that exist, by node."""
    found = []
    for i in range(s.nodes):
        with contextlib.suppress(ValueError):
            found.append(ray.util.get_placement_group(f"{POOL}-node{i}"))
    return found


def give_back(s: Standing) -> bool:
    """Remove the pool's groups (which ends its processes); whether there was any."""
    groups = _groups(s)
    placement.remove_groups(groups)
    return bool(groups)


def refill() -> None:
    """At the end of a launch on a `megaray up --warm` cluster without its pool (taken, given back
    for another layout, or idle): the next one, started in the background (it is detached)."""
    s = running()
    if s is None or not s.warm or len(_groups(s)) == s.nodes:
        return
    try:
        fill(s, wait=False)
    except Exception as e:  # the next launch starts cold, and says so
        log.warning("could not refill the warm pool: %s", str(e).splitlines()[0])
