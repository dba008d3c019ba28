"""Where a gang's ranks come from, one strategy each, tried in order (`rank_sources`): the failed
attempt's warm spares, a host gang's bundles (a colocated rank group), the warm pool of
`megaray up --warm`, or placement groups placed anew. Each gives a `Placed`, or None to let the next
try; fresh placement always gives one (or raises)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from ...core.elastic import NodeChoice, ScalingPolicy
from ...core.errors import UsageError
from ...core.spec import LaunchSpec
from ...core.topology import RankReport, RankSlot, assign_ranks, order_nodes, renumbered
from ..cluster import pool
from ..lifecycle.stop import StopSignal
from . import placement
from .spares import SparePool, SparesUnusable

log = logging.getLogger("megaray")

# a relaunch with --nodes MIN:MAX waits this long for its groups to be placed before it goes on with
# fewer (at least MIN): the nodes left hold one at once; a lost node's replacement is not waited for
RELAUNCH_SETTLE_S = 5.0
# a grow's relaunch saw room for its nodes: it waits up to this long for them all before it goes on
# with what is placed (a healed node's raylet was seen to take some seconds to place again)
GROW_SETTLE_S = 60.0


@dataclass(frozen=True)
class PlaceRequest:
    """What a gang asks of the sources besides its spec: its `name` (its placement groups are
    `{name}-node{i}`), its `attempt` (only a launch's first may take the warm pool, and its job name
    must be free on the cluster), whether the cluster can grow (`fixed_size`: a layout that does not
    fit fails at once), the nodes an earlier attempt lost (`avoid`), the launch's `scaling` policy
    (None: the spec's node range as it is), and whether it is a grow's relaunch (`growing`: it waits
    for the nodes it saw room for)."""

    name: str
    attempt: int = 0
    fixed_size: bool = False
    avoid: frozenset[str] = frozenset()
    scaling: ScalingPolicy | None = None
    growing: bool = False


class Source(StrEnum):
    SPARES = "warm spares"  # the previous attempt's, already importing in the same bundles
    HOST = "host bundles"  # another gang's bundles, shared rank for rank
    POOL = "warm pool"  # `megaray up --warm`'s processes
    FRESH = "placed anew"


@dataclass
class Placed:
    """What a source gives a gang: its groups and rank slots, and for sources whose processes already
    run (spares, pool) their actors and reports."""

    source: Source
    groups: list
    slots: list[RankSlot]
    actors: list = field(default_factory=list)
    reports: list[RankReport] = field(default_factory=list)
    replaced_pids: list[int | None] | None = None  # the ranks' processes that spares take over from
    sink: Any = None  # the output sink the pool started ahead on the driver's node
    size: NodeChoice | None = None  # with `--nodes MIN:MAX`, how many nodes it has and why

    @property
    def started(self) -> bool:
        """Its actors run already: the gang starts none, and they get their GPU ids with their env."""
        return self.source in (Source.SPARES, Source.POOL)

    @property
    def owns_groups(self) -> bool:
        """Whether the gang's teardown removes the groups: a host gang's stay with the host."""
        return self.source is not Source.HOST


class RankSource(Protocol):
    def take(self) -> Placed | None: ...


@dataclass
class FromSpares:
    """The failed attempt's spares. With --nodes MIN:MAX, when some are on a lost node, those of the
    nodes left take over if their count is one the target can run on, at least MIN."""

    spares: SparePool
    stop: StopSignal
    spec: LaunchSpec
    scaling: ScalingPolicy
    avoid: frozenset[str] = frozenset()

    def take(self) -> Placed | None:
        size, spares = None, self.spares
        if lost := ", ".join(sorted({s.node_ip for s in spares.slots if s.node_id in self.avoid})):
            size = self._shrunk()
            if size is None:
                log.warning("the warm spares on %s are on a lost node: placing every rank anew", lost)
                spares.discard(groups=True)
                return None
            log.info("the warm spares of the %d node(s) left take over (%s was lost)", size.nodes, lost)
            spares.without(set(self.avoid), self.spec.gpus_per_node)
        try:
            reports = self.spares.take_over(self.stop)
        except SparesUnusable as e:
            log.warning("the warm spares cannot take over (%s): placing every rank anew", e)
            self.spares.discard(groups=True)
            return None
        s = self.spares
        pids = list(s.replaces_pids)
        return Placed(Source.SPARES, s.groups, s.slots, list(s.actors), reports, pids, size=size)

    def _shrunk(self) -> NodeChoice | None:
        """How many nodes the spares left make, when the launch is elastic and the target takes it."""
        left = len({s.node_id for s in self.spares.slots if s.node_id not in self.avoid})
        return NodeChoice(left, left) if self.scaling.takes(left) else None


@dataclass
class FromHost:
    groups: list
    slots: list[RankSlot]

    def take(self) -> Placed:
        return Placed(Source.HOST, self.groups, self.slots)


@dataclass
class FromPool:
    """The warm pool, when this launch's layout is its (driver/cluster/pool.py)."""

    spec: LaunchSpec
    stop: StopSignal
    start_env: dict[str, str]

    def take(self) -> Placed | None:
        taken = pool.take(self.spec, self.stop, self.start_env)
        if taken is None:
            return None
        return Placed(Source.POOL, taken.groups, taken.slots, taken.actors, taken.reports, sink=taken.sink)


@dataclass
class Fresh:
    """A placement group per node on distinct nodes (placement.place_groups), none on `avoid`. With
    `--nodes MIN:MAX`, as many as were placed within `settle_s`, at least MIN, less any count the
    target cannot run on (`scaling`, core/elastic.py): the first nodes in rank order are kept."""

    spec: LaunchSpec
    name: str
    stop: StopSignal
    fixed_size: bool
    scaling: ScalingPolicy
    avoid: frozenset[str] = frozenset()
    settle_s: float | None = None

    def take(self) -> Placed:
        spec = self.spec
        avoid = tuple(sorted(self.avoid))
        groups = placement.place_groups(
            spec, self.name, self.stop, self.fixed_size, exclude=avoid, settle_s=self.settle_s
        )
        nodes = order_nodes(placement.resolve_nodes(groups))
        choice = None
        if spec.node_range.elastic:
            choice = self.scaling.size(len(groups))
            if choice.nodes is None:
                placement.remove_groups(groups)
                raise UsageError(f"--nodes {spec.node_range}: {choice.describe(spec.node_range)}")
            kept = nodes[: choice.nodes]
            placement.remove_groups([groups[n.group] for n in nodes[choice.nodes :]])
            groups, nodes = [groups[n.group] for n in kept], renumbered(kept)
        return Placed(Source.FRESH, groups, assign_ranks(nodes, spec.gpus_per_node), size=choice)


def rank_sources(
    spec: LaunchSpec, stop: StopSignal, ask: PlaceRequest, start_env: dict[str, str],
    spares: SparePool | None = None, host: tuple[list, list[RankSlot]] | None = None,
) -> list[RankSource]:  # fmt: skip
    """In the order they are tried. The pool serves only a launch's first attempt (a relaunch has its
    spares, or places anew), and a first attempt's job name must be free on the cluster."""
    sources: list[RankSource] = []
    scaling = ask.scaling or ScalingPolicy(spec.node_range)  # a rank group's: its fixed node count
    if spares is not None:
        sources.append(FromSpares(spares, stop, spec, scaling, ask.avoid))
    if host is not None:
        return [*sources, FromHost(*host)]
    first = ask.attempt == 0
    if first:
        placement.check_name_free(spec.job_name)
        sources.append(FromPool(spec, stop, start_env))
    # a relaunch with --nodes MIN:MAX goes on at once with the nodes that hold a group now; a grow's
    # waits for the nodes it saw room for
    settle_s = None if first else GROW_SETTLE_S if ask.growing else RELAUNCH_SETTLE_S
    return [*sources, Fresh(spec, ask.name, stop, ask.fixed_size, scaling, ask.avoid, settle_s)]
