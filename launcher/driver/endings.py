"""How ranks end, watched where they run: a returned rank's process finishing its exit, a hung rank's
state and stack. Each uses one task per node, pinned there, that reads the processes by pid."""

from __future__ import annotations

import dataclasses
import logging
import socket
from typing import TYPE_CHECKING, Any

import ray

from ..core.errors import RankFailure
from ..core.topology import format_rank_ranges
from ..rank.probes import wait_exited
from .actors import first_line, on_node, wait_all
from .supervise import StopSignal

if TYPE_CHECKING:
    from .gang import RankHandle

log = logging.getLogger("megaray")


def exit_gracefully(
    handles: tuple[RankHandle, ...], lingering: dict[int, list[str]], grace_s: float, stop: StopSignal
) -> None:
    """Watch the processes of ranks told to exit end as Python processes do (non-daemon threads
    joined, atexit handlers run: trackers flush, uploads finish), each by a task on its node; kill
    and name those still running after `grace_s`. Ctrl-C stops the wait."""
    by_node: dict[str, list[RankHandle]] = {}
    for h in handles:
        by_node.setdefault(h.report.node_id, []).append(h)
    task = ray.remote(wait_exited)
    refs = {
        node: task.options(**on_node(node)).remote([h.report.pid for h in hs], grace_s)
        for node, hs in by_node.items()
    }
    wait_all(list(refs.values()), grace_s + 60, stop)
    killed = []
    for node, ref in refs.items():
        try:
            took = ray.get(ref, timeout=0)
        except ray.exceptions.RayError as e:
            log.warning("could not watch the ranks on node %s exit: %s", node[:8], first_line(e))
            continue
        killed += [h.slot.rank for h, t in zip(by_node[node], took, strict=True) if t is None]
    if killed:
        still = sorted({x for r in killed for x in lingering.get(r, [])})
        log.warning(
            "rank(s) %s still running %gs after the program returned (%s): killed; give them longer "
            "with --exit-grace", format_rank_ranges(killed), grace_s, ", ".join(still) or "exit handlers",
        )  # fmt: skip


def node_lost(node_id: str) -> bool:
    """Whether a node is gone: dead for Ray already, or its raylet refuses or ignores a connection
    (a node whose raylet died, or whose link was cut, before Ray's health checks tell)."""
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    if node is None or not node["Alive"]:
        return True
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=0.5):
            return False
    except OSError:
        return True


def inspect_hang(handles: tuple[RankHandle, ...], idle_s: float) -> list[RankFailure]:
    """Every rank's state and stack, read by a task on its node; one failure per rank."""
    from ..core.hang import hang_failures
    from ..rank.probes import inspect_processes

    log.error("no output or progress from any rank for %.0fs: reading every rank's stack", idle_s)
    by_node: dict[str, list[int]] = {}
    for h in handles:
        by_node.setdefault(h.report.node_id, []).append(h.slot.rank)
    task = ray.remote(inspect_processes)
    refs = {
        node: task.options(**on_node(node)).remote([handles[r].report.pid for r in ranks])
        for node, ranks in by_node.items()
    }
    seen: dict[int, dict[str, Any]] = {}
    for node, ref in refs.items():
        try:
            for r, found in zip(by_node[node], ray.get(ref, timeout=60), strict=True):
                seen[r] = found
        except ray.exceptions.RayError as e:
            log.warning("could not inspect the ranks on node %s: %s", node[:8], first_line(e))
    for r in sorted(seen):
        if seen[r].get("stack"):
            log.error("stack of rank %d (pid %s):\n%s", r, seen[r]["pid"], seen[r]["stack"].rstrip())
    return hang_failures(idle_s, [dataclasses.asdict(h.info) for h in handles], seen)
