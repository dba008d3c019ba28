"""Growing back (`--nodes MIN:MAX`): while an attempt runs on fewer than MAX nodes, whether the cluster
has room for more (a node joined, or a lost one answers again), and when to end the attempt to
relaunch on them (core/elastic.py `GrowPolicy`): `GrowTo`, which the controller takes as a relaunch
that is not a failure (driver/controller.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..core.elastic import GrowPolicy, GrowTo, NodeRange, choose_nodes
from ..core.spec import LaunchSpec
from . import rayprivate
from .endings import node_lost
from .placement import bundle_for, nodes_that_fit

log = logging.getLogger("megaray")

ROOM_EVERY_S = 5.0  # how often the cluster is asked for room (one GCS call, a probe per lost node)


class GrowWatch:
    """`spec` is the attempt's (its node count), `asked` the launch's range; `held` the attempt's
    nodes, `lost` the launch's lost nodes (one that answers again is taken off: it can be placed on
    again)."""

    def __init__(
        self, spec: LaunchSpec, asked: NodeRange, policy: GrowPolicy, held: set[str], lost: set[str],
        size_problem: Callable[[int], str | None], clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        self.spec, self.asked, self.policy = spec, asked, policy
        self.held, self.lost, self.size_problem, self.clock = held, lost, size_problem, clock
        self.room_since: float | None = None
        self.target = spec.nodes
        self.next_look = clock() + ROOM_EVERY_S

    def check(self, last_checkpoint_at: float | None) -> GrowTo | None:
        """GrowTo once it is time, else None; `last_checkpoint_at`: when the target last said it saved
        one (this clock)."""
        now = self.clock()
        if now >= self.next_look:
            self.next_look = now + ROOM_EVERY_S
            self._look(now)
        if not self.policy.grow_now(self.room_since, last_checkpoint_at, now):
            return None
        saved = last_checkpoint_at is not None and last_checkpoint_at >= self.room_since
        when = "a checkpoint was saved since" if saved else f"for {now - self.room_since:.0f}s"
        return GrowTo(
            self.target,
            f"the cluster has room for {self.target} node(s) of --nodes {self.asked} (running on "
            f"{self.spec.nodes}), {when}",
        )

    def _look(self, now: float) -> None:
        self._forgive()
        free = {
            node_id: res
            for node_id, res in rayprivate.available_resources_per_node().items()
            if node_id not in self.held and node_id not in self.lost
        }
        more = nodes_that_fit(free, bundle_for(self.spec), self.spec.gpus_per_node)
        choice = choose_nodes(self.spec.nodes + more, self.asked, self.size_problem)
        if choice.nodes is not None and choice.nodes > self.spec.nodes:
            if self.room_since is None:
                log.info(
                    "the cluster has room for %d node(s) of --nodes %s (running on %d): growing %s",
                    choice.nodes, self.asked, self.spec.nodes, self.policy.describe(),
                )  # fmt: skip
                self.room_since = now
            self.target = choice.nodes
        else:
            self.room_since, self.target = None, self.spec.nodes

    def _forgive(self) -> None:
        """A lost node that Ray still counts alive and whose raylet answers again (a healed link)."""
        for node_id in [n for n in self.lost if not node_lost(n)]:
            log.info("node %s answers again: it can be placed on again", node_id[:8])
            self.lost.discard(node_id)
