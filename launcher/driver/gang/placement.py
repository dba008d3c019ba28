"""Placement groups: one STRICT_PACK group per node, all requested at once, removed on every exit."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from ...core.elastic import NodeRange
from ...core.errors import ResourceError, UsageError
from ...core.placing import (
    PlaceGoal,
    feasibility_problem,
    nodes_that_fit,
    room_wait_s,
    sort_out,
    without_autoscaler,
)
from ...core.spec import LaunchSpec
from ...core.topology import NodeSlot
from ..cluster import rayprivate
from ..lifecycle.stop import StopSignal
from .actors import wait_all

log = logging.getLogger("megaray")
NODE_ID_LABEL = "ray.io/node-id"  # a label Ray gives every node


def bundle_for(spec: LaunchSpec) -> dict[str, float]:
    bundle: dict[str, float] = {}
    if spec.uses_gpus:
        bundle["GPU"] = 1
    if spec.cpus_per_rank > 0:
        bundle["CPU"] = spec.cpus_per_rank
    return bundle


def describe_request(spec: LaunchSpec, wanted: NodeRange | None = None) -> str:
    """`wanted`: the launch's `--nodes MIN:MAX` where `spec` holds the count asked this time (a
    relaunch below MIN was said as '3 node(s)' of --nodes 2:3, the 2 it needed unsaid)."""
    per = ", ".join(f"{k} {v:g}" for k, v in bundle_for(spec).items())
    unit = "GPUs" if spec.uses_gpus else "ranks"
    count = f"{spec.nodes} node(s)"
    if wanted is not None and wanted.elastic:
        count = f"at least {wanted.min} node(s) of --nodes {wanted}"
    return (
        f"{count} x {spec.gpus_per_node} {unit}, each node one group of "
        f"{spec.gpus_per_node} bundles of {{{per}}} (STRICT_PACK)"
    )


def describe_nodes(lost: tuple[str, ...] = ()) -> str:
    """What each live node has, free and total, for the resource error; `lost`: the nodes this job
    found lost, which Ray may still count alive and free (its health checks take ~65 s)."""
    total = rayprivate.total_resources_per_node()
    free = rayprivate.available_resources_per_node()
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    parts = []
    for node_id, res in sorted(total.items(), key=lambda kv: ips.get(kv[0], "")):
        avail = free.get(node_id, {})
        shown = [f"{k} {avail.get(k, 0):g}/{res[k]:g} free" for k in ("GPU", "CPU") if k in res]
        said = "lost by this job" if node_id in lost else ", ".join(shown) or "no GPU/CPU"
        parts.append(f"{ips.get(node_id, node_id[:8])} {node_id[:8]}: {said}")
    return "; ".join(parts) or "no live nodes"


def describe_lost(exclude: tuple[str, ...]) -> str:
    """The nodes an earlier attempt lost, which placing leaves out, for the resource error (#46: a
    relaunch below what it needs said 'lower --nodes' and never which node had gone)."""
    if not exclude:
        return ""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    shown = ", ".join(f"{ips.get(node, '?')} (node id {node[:8]})" for node in exclude)
    return f"; left out: the node(s) this job lost, {shown}"


def nodes_that_could_fit(spec: LaunchSpec, exclude: tuple[str, ...] = (), free: bool = False) -> int:
    """How many of the cluster's nodes (but `exclude`) could hold one of the launch's groups, empty
    (or with what is `free` now)."""
    per_node = rayprivate.available_resources_per_node() if free else rayprivate.total_resources_per_node()
    kept = {k: v for k, v in per_node.items() if k not in exclude}
    return nodes_that_fit(kept, bundle_for(spec), spec.gpus_per_node)


def groups_of_job(job: str) -> list[str]:
    """Live placement groups that a launch named `job` creates (`job-node<i>`, `job-a<k>-node<i>`)."""
    mine = re.compile(rf"^{re.escape(job)}(-a\d+)?-node\d+$")
    return sorted(
        g["name"]
        for g in placement_group_table().values()
        if mine.match(g["name"]) and g["state"] != "REMOVED"
    )


def groups_waiting(but: str) -> list[str]:
    """Placement groups not yet placed (a launch waiting for room), but those named `but`..."""
    return sorted(
        g["name"]
        for g in placement_group_table().values()
        if g["state"] == "PENDING" and not g["name"].startswith(but)
    )


def check_name_free(job: str) -> None:
    """A second launch under a running job's name would collide with its groups and actors."""
    taken = groups_of_job(job)
    if taken:
        raise UsageError(
            f"job name {job} is in use on this cluster (placement group {taken[0]} exists): choose another "
            f"--job-name, or stop that job first (Ctrl-C its driver, or `megaray stop {job}` for a Ray job)"
        )


def create_groups(
    spec: LaunchSpec, name: str | None = None, detached: bool = False, exclude: tuple[str, ...] = ()
) -> list[PlacementGroup]:
    """All groups are requested before any is waited on, so they are scheduled together. Each request
    waits for the GCS's answer: they are sent REMOVERS at once (1,024 nodes one after another would
    take a second or more at 1-2 ms a round trip)."""

    def create(i: int) -> PlacementGroup:
        return create_group(spec, f"{name or spec.job_name}-node{i}", list(exclude), detached=detached)

    if spec.nodes <= 2:
        return [create(i) for i in range(spec.nodes)]
    workers = min(REMOVERS, spec.nodes)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megaray-place") as pool:
        return list(pool.map(create, range(spec.nodes)))


def create_group(
    spec: LaunchSpec, name: str, exclude_nodes: list[str] = (), detached: bool = False
) -> PlacementGroup:
    """One node's group: a bundle per rank, all on one node, none of `exclude_nodes` (Ray node ids)."""
    bundle = bundle_for(spec)
    selector = (
        [{NODE_ID_LABEL: f"!in({','.join(exclude_nodes)})"}] * spec.gpus_per_node if exclude_nodes else None
    )
    return placement_group(
        [dict(bundle) for _ in range(spec.gpus_per_node)],
        strategy="STRICT_PACK",
        name=name,
        bundle_label_selector=selector,
        lifetime="detached" if detached else None,
    )


def cluster_cannot_grow() -> bool:
    import json

    try:
        raw = rayprivate.autoscaling_status()
        return bool(without_autoscaler(json.loads(raw) if raw else None))
    except Exception:  # no status, or one this Ray writes differently: assume it can grow
        return False


NO_AUTOSCALER = (
    "or add a node that can hold a group (`ray start --address HEAD:PORT` on another machine): this "
    "cluster has no autoscaler, so none comes by itself (or wait longer for one with --placement-timeout)"
)


REMOVERS = 16  # placement groups created, or removed, at once
FIXED_SIZE_WAIT_S = 10.0  # on a cluster megaray started itself (no autoscaler, no other node to come)


def wait_s(spec: LaunchSpec, fixed_size: bool, free_fit: int = 0, needed: int = 1) -> float:
    """How long placing waits for room (core/placing.py `room_wait_s`): --placement-timeout, at most
    FIXED_SIZE_WAIT_S on a cluster that cannot grow unless its free resources already hold the
    `needed` groups (`free_fit` nodes could hold one now). Without those counts: the wait for room
    that is not free, what a relaunch's line says it waits."""
    return room_wait_s(spec.placement_timeout_s, fixed_size, free_fit, needed, FIXED_SIZE_WAIT_S)


def place_groups(
    spec: LaunchSpec, name: str, stop: StopSignal, fixed_size: bool, detached: bool = False,
    exclude: tuple[str, ...] = (), settle_s: float | None = None,
) -> list[PlacementGroup]:  # fmt: skip
    """One group per node, each on a Ray node of its own, waited for up to --placement-timeout.

    All groups are requested at once, so that they are scheduled together; Ray keeps no two
    STRICT_PACK groups apart, so a group that landed on a node another group holds is placed again,
    with the nodes of the others excluded by label (`ray.io/node-id`). `exclude`: nodes never to use
    (found lost by megaray before Ray's health checks tell).

    With `--nodes MIN:MAX` it asks for MAX groups (on a cluster that cannot grow, as many as its nodes
    can hold) and keeps what is placed once `settle_s` has passed (default: the whole wait), at least
    MIN: the groups not placed by then are removed.
    """
    wanted = spec.node_range
    fit = nodes_that_could_fit(spec, exclude)
    asked = min(wanted.max, max(fit, wanted.min)) if fixed_size else wanted.max
    spec = dataclasses.replace(spec, nodes=asked)
    problem = feasibility_problem(fit, wanted.min if wanted.elastic else asked)
    at_least = wanted.min if wanted.elastic else asked
    free_fit = nodes_that_could_fit(spec, exclude, free=True) if fixed_size and not problem else 0
    waits = wait_s(spec, fixed_size, free_fit, asked)  # all it asks free: only a slow placement to wait for
    if wanted.elastic and not problem and fit < asked:
        wait = f"waiting up to {waits:g}s for {asked}, then starting with as many as are"
        how = f"{wait} placed" if settle_s is None else f"going on with those placed within {settle_s:g}s"
        log.warning("only %d node(s) of the cluster can hold a group: %s (at least %d)", fit, how, wanted.min)
    if problem and fixed_size:
        raise resource_error(
            spec, 0, problem + describe_lost(exclude), describe_nodes(exclude), can_grow=False, wanted=wanted
        )
    fix = None
    if problem and cluster_cannot_grow():
        # No autoscaler will add a node; one started by hand, or a KubeRay replica still booting, can.
        fix = NO_AUTOSCALER
        cpu = "; without GPUs, --device cpu runs the ranks on CPUs (gloo)" if spec.uses_gpus else ""
        log.warning(
            "%s, and this cluster has no autoscaler: waiting up to %gs for a node started by hand (ray "
            "start, Slurm, a KubeRay replica still booting); Ctrl-C stops the wait%s",
            problem, spec.placement_timeout_s, cpu,
        )  # fmt: skip
    elif problem:
        log.warning("%s; waiting up to %gs for more nodes", problem, spec.placement_timeout_s)
    before = describe_nodes(exclude)  # what others left free, for the message if we time out
    deadline = time.monotonic() + waits
    settle = deadline if settle_s is None else min(deadline, time.monotonic() + settle_s)
    groups = create_groups(spec, name, detached, exclude)
    goal = PlaceGoal.of(asked, at_least, fit, settle, deadline, again=settle_s is not None)
    try:
        placed = _place_enough(spec, name, groups, goal, stop, detached, exclude)
    except _NotPlaced as e:
        remove_groups(groups)
        why = f"not placed within {waits:g}s on {at_least} distinct nodes{describe_lost(exclude)}"
        raise resource_error(
            spec, e.placed, f"{problem}; {why}" if problem else why, before, can_grow=not fixed_size, fix=fix,
            wanted=wanted,
        ) from None  # fmt: skip
    except BaseException:
        remove_groups(groups)
        raise
    remove_groups([g for i, g in enumerate(groups) if i not in placed])
    return [groups[i] for i in sorted(placed)]


class _NotPlaced(Exception):
    def __init__(self, placed: int):
        self.placed = placed


def _place_enough(
    spec: LaunchSpec, name: str, groups: list[PlacementGroup], goal: PlaceGoal, stop: StopSignal,
    detached: bool, exclude: tuple[str, ...],
) -> set[int]:  # fmt: skip
    """The indexes of the groups placed on distinct nodes, once `goal` is met; `_NotPlaced` at its
    deadline. A group that lands on a node an earlier one holds is placed again (`groups[i]`
    replaced), away from every node held."""
    refs = [g.ready() for g in groups]
    placed: set[int] = set()
    while True:
        pending = [i for i in range(len(groups)) if i not in placed]
        now = time.monotonic()
        if not pending or goal.met(len(placed), now):
            return placed
        if now >= goal.deadline:
            raise _NotPlaced(len(placed))
        until = goal.settle if len(placed) >= goal.at_least else goal.deadline
        # a quarter of a second at a time: a group placed is seen at once, not when all are
        ready = set(wait_all([refs[i] for i in pending], max(0.0, min(until - now, 0.25)), stop))
        newly = [i for i in pending if refs[i] in ready]
        if not newly:
            continue
        order = sorted(placed) + newly
        nodes = dict(zip(order, nodes_of([groups[i] for i in order]), strict=True))
        held = {nodes[i] for i in placed}
        kept, again = sort_out(held, [(i, nodes[i]) for i in newly])
        placed.update(kept)
        if again:
            remove_groups([groups[i] for i in again])
            away = [*held, *(nodes[i] for i in kept), *exclude]
            for i in again:
                groups[i] = create_group(spec, f"{name}-node{i}", exclude_nodes=away, detached=detached)
                refs[i] = groups[i].ready()


def nodes_of(groups: list[PlacementGroup]) -> list[str]:
    """The node of each group's bundle 0, from one read of the GCS's table, not one call per group."""
    if len(groups) == 1:
        return [placement_group_table(groups[0])["bundles_to_node_id"][0]]
    table = placement_group_table()
    return [table[g.id.hex()]["bundles_to_node_id"][0] for g in groups]


def resolve_nodes(groups: list[PlacementGroup]) -> list[NodeSlot]:
    """The node of each group's bundle 0, from the GCS tables (no task needs to start)."""
    nodes = {n["NodeID"]: n for n in ray.nodes()}
    slots = []
    for i, node_id in enumerate(nodes_of(groups)):
        node = nodes[node_id]
        slots.append(
            NodeSlot(
                group=i,
                node_ip=node["NodeManagerAddress"],
                node_id=node_id,
                hostname=node.get("NodeManagerHostname", ""),
            )
        )
    return slots


def resource_error(
    spec: LaunchSpec, placed: int, why: str, nodes: str, can_grow: bool, fix: str | None = None,
    wanted: NodeRange | None = None,
) -> ResourceError:  # fmt: skip
    cpu = "; without GPUs, --device cpu runs the ranks on CPUs (gloo)" if spec.uses_gpus else ""
    fix = (
        (fix + cpu)
        if fix
        else (
            "free or add nodes, or wait longer with --placement-timeout"
            if can_grow
            else "or attach to a larger cluster with --address (a local Ray, started for this run or by "
            "`megaray up`, cannot grow: `megaray down`, then `megaray up` with the layout)"
            + (
                "; without one, --device cpu runs the ranks on CPUs (gloo), nodes simulated here"
                if spec.uses_gpus
                else ""
            )
        )
    )
    return ResourceError(
        f"the cluster cannot fit {describe_request(spec, wanted)}: {why} "
        f"({placed} of {spec.nodes} groups placed). "
        f"Cluster before this launch: {nodes}. Lower --nodes / --gpus-per-node / --cpus-per-rank, {fix}"
    )


def remove_groups(groups: list[PlacementGroup]) -> None:
    """Each removal waits for the GCS's answer: many are sent at once (64 groups: 25-31 ms against
    56-64 ms one after another, on one node; the gap grows with the GCS's distance)."""

    def remove(g: PlacementGroup) -> None:
        with contextlib.suppress(Exception):  # already removed, or the cluster is gone
            remove_placement_group(g)

    if len(groups) <= 1:
        for g in groups:
            remove(g)
        return
    with ThreadPoolExecutor(
        max_workers=min(REMOVERS, len(groups)), thread_name_prefix="megaray-remove"
    ) as pool:
        list(pool.map(remove, groups))
