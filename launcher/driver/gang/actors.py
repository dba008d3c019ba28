"""Starting and stopping Ray actors and tasks the way every part of the driver needs them: a rank's
actor in its bundle, a helper pinned to one node, and kills that never raise."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ...core.spec import RAY_NAMESPACE
from ..lifecycle.stop import StopSignal


def start_rank_actor(
    name: str | None,
    group: Any,
    bundle: int,
    *,
    job: str,
    rank: int,
    node_ip: str,
    num_cpus: float,
    num_gpus: float,
    pooled: dict[str, Any] | None = None,
    start_env: Mapping[str, str] | None = None,
) -> Any:
    """One RankActor in bundle `bundle` of placement group `group`. A launch's are unnamed (`name`
    None): Ray registers a name with the GCS before `.remote()` returns, a round trip per rank (2.7 ms
    against 1.3 ms unnamed, measured on one node); `ray list actors` shows them by their placement
    group (`<job>-node<i>`) and their repr (`rank3@10.0.0.9/gpu1`). The warm pool's are named: a
    later launch finds them by name.
    `pooled`: a warm pool's actor (driver/cluster/pool.py), detached, importing as it starts. `start_env`:
    variables its process must have from its start (core/rankenv.startup_env), which Ray gives a
    worker it starts for this runtime environment."""
    return (
        _rank_actor_class()
        .options(
            name=name,
            namespace=RAY_NAMESPACE,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_restarts=0,
            lifetime="detached" if pooled else None,
            # a runtime environment of its own only when needed: a worker Ray started ahead (for
            # none) cannot take it, and starting one costs about a second of the launch
            runtime_env={"env_vars": dict(start_env)} if start_env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
        )
        .remote(job, rank, node_ip, pooled)
    )


@functools.cache
def _rank_actor_class() -> Any:
    """One Ray actor class for every rank: Ray exports (pickles and disassembles) each new one, about
    60 ms a rank on a 2-core machine."""
    from ...rank.actor import RankActor

    return ray.remote(RankActor)


def on_node(node_id: str) -> dict[str, Any]:
    """Options for a helper (a task or actor) that must run on `node_id` and reserve nothing there.
    Like the ranks, it runs at the node's worker niceness (core/rankenv.py NODE_DEFAULTS)."""
    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def kill_actors(actors: Iterable[Any]) -> None:
    for a in actors:
        with contextlib.suppress(Exception):  # already dead, or the cluster is gone
            ray.kill(a, no_restart=True)


def wait_all(
    refs: list, timeout_s: float, stop: StopSignal, check: Callable[[], None] | None = None,
    settled: Callable[[list], set] | None = None,
) -> list:  # fmt: skip
    """`ray.wait` for all refs, in slices so a stop signal is seen quickly; returns the ready ones.
    `check` runs every slice too (and may raise): the nodes' probes while ranks start. `settled`
    says which of the pending refs need no more waiting for (their process seen gone on its node)."""
    deadline = time.monotonic() + timeout_s
    ready: list = []
    pending = list(refs)  # each slice asks about these only: 32,768 actors start over a minute
    while True:
        stop.check()
        if check is not None:
            check()
        if settled is not None and pending and (known := settled(pending)):
            pending = [r for r in pending if r not in known]
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            return ready
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, 0.25))
        ready += done


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
