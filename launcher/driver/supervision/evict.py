"""Dropping a slow node (`--evict-stragglers AFTER_S`, issue #47): a node whose rank the straggler
watch (stragglers.py) has named slow for AFTER_S is dropped at the next checkpoint, the job
relaunched without it (kept off for the rest of the launch, as a lost node is) and grown back when
another node has room. The rule is core/elastic.py's (`ScalingPolicy.evict_now`); here the watch
feeds it and, where a slow rank is not dropped, says once what it costs and what would fix it: a
slow node drags every rank of a synchronous job, for as long as the run lasts."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from ...core.elastic import Evict, ScalingPolicy
from ...core.goodput import slowed_cost
from ...core.progress import duration
from .stragglers import StragglerWatch

log = logging.getLogger("megaray")

ADVISE_AFTER_S = 60.0  # a rank slow this long (or --evict-stragglers') is said what it costs, once


class EvictWatch:
    """`node_of_rank`: each rank's node id; `names`: how the console names each node."""

    def __init__(
        self, scaling: ScalingPolicy, stragglers: StragglerWatch, node_of_rank: list[str],
        names: dict[str, str], clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        self.scaling, self.stragglers, self.clock = scaling, stragglers, clock
        self.node_of_rank, self.names = node_of_rank, names
        self.advised: set[int] = set()  # the ranks said once

    def check(self, running: int, room: int, last_checkpoint_at: float | None) -> Evict | None:
        """The node to drop now, if any; `running` nodes, with `room` for more on the cluster."""
        if not self.stragglers.slow:
            return None
        now, slow = self.clock(), {}
        for rank, (since, _) in self.stragglers.slow.items():
            node = self.node_of_rank[rank]
            slow[node] = min(since, slow.get(node, since))
        evict = self.scaling.evict_now(running, room, slow, last_checkpoint_at, now)
        if evict is not None:
            return dataclasses.replace(evict, name=self.names.get(evict.node_id, ""))
        self._advise(running, room, now)
        return None

    def _advise(self, running: int, room: int, now: float) -> None:
        after = self.scaling.evict.after_s or ADVISE_AFTER_S
        for rank, (since, slowdown) in self.stragglers.slow.items():
            if rank in self.advised or now - since < after:
                continue
            self.advised.add(rank)
            cost = slowed_cost(now - since, slowdown)
            head = (
                f"rank {rank} on {self.names.get(self.node_of_rank[rank], '?')} has been slow for "
                f"{duration(now - since)} (about {slowdown:.1f}x its peers): it has cost the job about "
                f"{duration(cost)} of training so far"
            )
            log.warning("%s; %s", head, self._fix(running, room))

    def _fix(self, running: int, room: int) -> str:
        """What would stop it costing more."""
        scaling = self.scaling
        if scaling.evict.after_s is None:
            how = (
                "at its next checkpoint"
                if scaling.grow.at_checkpoint
                else "(with --grow-after: it resumes itself)"
            )
            ask = (
                "--evict-stragglers S"
                if scaling.asked.elastic
                else "--nodes MIN:MAX with --evict-stragglers S"
            )
            return f"{ask} would drop its node {how} and relaunch without it"
        if (why := scaling.without_slow_node(running, room)) is not None:
            return f"its node is not dropped: {why}"
        if scaling.grow.at_checkpoint:
            return "its node is dropped at the target's next checkpoint"
        return "its node is not dropped: a plain program is relaunched while it runs only with --grow-after"
