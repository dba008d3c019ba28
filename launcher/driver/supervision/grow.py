"""Growing back (`--nodes MIN:MAX`): while an attempt runs on fewer than MAX nodes, whether the cluster
has room for more (a node joined, or a lost one answers again), and when to end the attempt to
relaunch on them (core/elastic.py `GrowPolicy`): `GrowTo`, which the controller takes as a relaunch
that is not a failure (driver/lifecycle/controller.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ...core.elastic import GrowTo, ScalingPolicy
from ...core.spec import LaunchSpec
from ..gang.placement import nodes_that_could_fit
from .rank_ends import node_lost

log = logging.getLogger("megaray")

ROOM_EVERY_S = 5.0  # how often the cluster is asked for room (one GCS call, a probe per lost node)


class GrowWatch:
    """`spec` is the attempt's (its node count); `scaling` the launch's policy; `held` the attempt's
    nodes, `lost` the launch's lost nodes (one that answers again is taken off: it can be placed on
    again)."""

    def __init__(
        self, spec: LaunchSpec, scaling: ScalingPolicy, held: set[str], lost: set[str],
        clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        self.spec, self.scaling, self.held, self.lost, self.clock = spec, scaling, held, lost, clock
        self.room_since: float | None = None
        self.target = spec.nodes
        self.next_look = clock() + ROOM_EVERY_S

    @property
    def room(self) -> int:
        """How many nodes more than it runs on the cluster has room for (as last looked)."""
        return max(0, self.target - self.spec.nodes)

    def check(self, last_checkpoint_at: float | None) -> GrowTo | None:
        """GrowTo once it is time, else None; `last_checkpoint_at`: when the target last said it saved
        one (this clock)."""
        now = self.clock()
        if now >= self.next_look:
            self.next_look = now + ROOM_EVERY_S
            self._look(now)
        return self.scaling.grow_now(self.spec.nodes, self.target, self.room_since, last_checkpoint_at, now)

    def _look(self, now: float) -> None:
        self._forgive()
        more = nodes_that_could_fit(self.spec, (*self.held, *self.lost), free=True)
        target = self.scaling.grow_to(self.spec.nodes, self.spec.nodes + more)
        if target is None:
            self.room_since, self.target = None, self.spec.nodes
            return
        if self.room_since is None:
            log.info(
                "the cluster has room for %d node(s) of --nodes %s (running on %d): growing %s",
                target, self.scaling.asked, self.spec.nodes, self.scaling.grow.describe(),
            )  # fmt: skip
            self.room_since = now
        self.target = target

    def _forgive(self) -> None:
        """A lost node that Ray still counts alive and whose raylet answers again (a healed link)."""
        for node_id in [n for n in self.lost if not node_lost(n)]:
            log.info("node %s answers again: it can be placed on again", node_id[:8])
            self.lost.discard(node_id)
