"""Placement's decisions, without Ray (driver/gang/placement.py asks Ray and acts on them): how many
nodes could hold a group, whether a cluster can grow by itself, which groups landed on a node another
holds, and when placing has placed enough."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


def nodes_that_fit(totals: Mapping[str, Mapping[str, float]], bundle: Mapping[str, float], count: int) -> int:
    """How many nodes could hold one whole group (`count` bundles) if they were empty."""
    return sum(all(res.get(k, 0) >= v * count for k, v in bundle.items()) for res in totals.values())


def room_wait_s(timeout_s: float, fixed_size: bool, free_fit: int, needed: int, cap_s: float) -> float:
    """How long placing waits for its groups: `timeout_s` (--placement-timeout), but at most `cap_s` on
    a cluster that cannot grow (`fixed_size`) whose free resources hold fewer than the `needed` groups
    (`free_fit` nodes could hold one as they are now): there room comes only when another job ends,
    and waiting longer than the bundles of a launch that just ended take to be freed only delays the
    error. Where the room is free, a slow placement (a loaded machine) is waited for as anywhere: a
    layout that fits was refused after 10 s with 'GPU 2/2 free, CPU 2/2 free' (session 42)."""
    if fixed_size and free_fit < needed:
        return min(timeout_s, cap_s)
    return timeout_s


def feasibility_problem(fit: int, needed: int) -> str | None:
    """A message when the cluster as it stands (`fit` nodes could hold a group) could never hold the
    `needed` groups, else None."""
    if fit >= needed:
        return None
    return f"only {fit} node(s) of the cluster can hold one group"


def without_autoscaler(status: Mapping | None) -> bool | None:
    """Whether Ray's autoscaler status (the head's monitor writes it) says no node can come by itself:
    with no autoscaling config the monitor runs read-only and gives every node a type of its own,
    `node_<node id>`. None when there is no status to tell (autoscaler v2, an old head)."""
    mapping = ((status or {}).get("autoscaler_report") or {}).get("node_type_mapping")
    if not mapping:
        return None
    return all(kind == f"node_{node_id}" for node_id, kind in mapping.items())


def sort_out(held: set[str], newly: list[tuple[int, str]]) -> tuple[list[int], list[int]]:
    """Of groups just placed, (index, node) in order: those on a node no group holds (kept), and those
    on a node held already, by an earlier group or one of these (to be placed again, together)."""
    seen, kept, again = set(held), [], []
    for i, node in newly:
        (again if node in seen else kept).append(i)
        seen.add(node)
    return kept, again


@dataclasses.dataclass(frozen=True)
class PlaceGoal:
    """When placing has placed enough: `at_once` groups (all asked, or all the cluster's nodes could
    hold), else at least `at_least` once `settle` (a monotonic time) has passed; never past `deadline`."""

    at_least: int
    at_once: int
    settle: float
    deadline: float

    @classmethod
    def of(
        cls, asked: int, at_least: int, fit: int, settle: float, deadline: float, again: bool
    ) -> PlaceGoal:
        """`asked` groups, of which `fit` the cluster's nodes could hold. A first launch waits for all it
        asked until `settle` (a node may still join). A relaunch or a grow (`again`) goes on once each
        node that could hold a group holds one: a lost or dropped node's replacement is not waited for,
        and no other node of the cluster has room to give."""
        return cls(at_least, min(asked, max(fit, at_least)) if again else asked, settle, deadline)

    def met(self, placed: int, now: float) -> bool:
        return placed >= self.at_once or (placed >= self.at_least and now >= self.settle)
