"""Warm spares: the next attempt's rank actors, started while this attempt runs, with torch and the
Megatron stack already imported, so that a restart skips Ray's worker start, the imports and the
placement.

A restart under torchrun (or a cold relaunch here) pays, per rank, a new Python process and the
imports again (torch alone is seconds, torch plus megatron-core about ten on a small machine), then
waits for placement. A spare is started into the same bundle as its rank, with no resources of its
own: the bundle keeps the GPU reserved, the spare uses it by index once its rank is gone, exactly as
the rank did (CUDA_VISIBLE_DEVICES lists the node's job GPUs, LOCAL_RANK picks one). Removing the
group kills the spare with it, so nothing outlives the job.

A spare is used only if every one of them answers and every group is still placed; otherwise (a
node was lost, a spare died) the relaunch places everything anew, as it would without spares.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from enum import Enum

import ray
from ray.util.placement_group import placement_group_table

from ...core.spec import LaunchSpec
from ...core.topology import NodeSlot, RankReport, assign_ranks, order_nodes, renumbered
from ..lifecycle.registry import runner_for
from ..lifecycle.stop import StopSignal
from . import placement
from .actors import first_line, kill_actors, start_rank_actor, wait_all
from .handle import RankHandle

log = logging.getLogger("megaray")

SPARE_ANSWER_S = 10.0  # a warm spare answers at once; one that does not is on a lost node
WARM_TIMEOUT_S = 300.0  # as long as a rank actor may take to start


class SpareState(Enum):
    WARMING = "importing"
    READY = "ready"
    FAILED = "failed"  # a spare died while importing: a restart places every rank anew
    HANDED_OVER = "handed over"  # to the next attempt, with the placement groups
    ADOPTED = "adopted"  # the next attempt's ranks run in them
    DISCARDED = "discarded"


class SparesUnusable(Exception):
    """Why the next attempt cannot take over the spares (a lost node, a dead spare, CUDA initialized)."""


class SparePool:
    """One spare actor per rank for the next attempt, in the ranks' own bundles, with no resources of
    their own; it keeps the attempt's placement groups, slots, GPU ids and process ids."""

    def __init__(
        self, name: str, spec: LaunchSpec, groups: list, ranks: tuple[RankHandle, ...],
        start_env: dict[str, str] | None = None,
    ):  # fmt: skip
        """`name`: the next attempt's; `ranks`: the running attempt's, in `groups`, whose env each
        spare is given to import with."""
        self.groups, self.slots = groups, [h.slot for h in ranks]
        self.gpu_ids = [h.report.gpu_ids for h in ranks]
        self.replaces_pids = [h.report.pid for h in ranks]
        slots, target, envs = self.slots, spec.target, [h.env.to_set for h in ranks]
        self.actors = [
            start_rank_actor(None, groups[s.group], s.bundle, job=spec.job_name, rank=s.rank,
                             node_ip=s.node_ip, num_cpus=0, num_gpus=0,  # the bundle holds the resources
                             start_env=start_env)
            for s in slots
        ]  # fmt: skip
        runner = runner_for(target)
        steps = runner.warm_imports(target)
        prepare = (runner, target)  # a recipe's config built ahead too
        self.warm_refs = [
            a.warm.remote(env, steps, prepare=prepare) for a, env in zip(self.actors, envs, strict=True)
        ]
        for a, ids in zip(self.actors, self.gpu_ids, strict=True):
            if ids:  # how much its rank uses there: room for the new rank before the old one is gone
                a.watch_gpu.remote(list(ids))
        self.started_at = time.monotonic()
        self.state = SpareState.WARMING
        log.info("starting %d warm spare(s) for a restart (importing %s)", len(self.actors), ", ".join(steps))

    @property
    def warming(self) -> bool:
        """Still importing: their load is on the ranks' nodes (driver/supervision/stragglers.py)."""
        return self.state is SpareState.WARMING

    def tend(self, attempt: int) -> None:
        """Say once when every spare has finished importing (they warm while the attempt trains)."""
        refs = self.warm_refs
        if not self.warming or len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            return
        try:
            results = ray.get(refs)
        except ray.exceptions.RayError as e:
            self.state = SpareState.FAILED
            log.warning("a warm spare failed: %s; a restart will place every rank anew", first_line(e))
            return
        self.state = SpareState.READY
        failed = sorted({step for r in results for step in r["failed"]})
        log.info(
            "%d warm spare(s) ready for restart %d in %.1f s%s",
            len(results),
            attempt,
            time.monotonic() - self.started_at,
            f" (could not import {', '.join(failed)}: the ranks will)" if failed else "",
        )

    def hand_over(self) -> SparePool | None:
        """After a failure: these spares, and the groups, for the next attempt (None if they failed)."""
        if self.state is SpareState.FAILED:
            return None
        self.state = SpareState.HANDED_OVER
        return self

    def take_over(self, stop: StopSignal) -> list[RankReport]:
        """For the next attempt: each spare's report, with the GPU ids of the rank it replaces; raises
        SparesUnusable when any of them cannot take over. A spare on a lost node may not be known dead
        to Ray yet: it does not answer, and that is enough."""
        for g in self.groups:
            state = placement_group_table(g).get("state")
            if state != "CREATED":
                raise SparesUnusable(f"placement group {g.id.hex()[:8]} is {state}: a node was lost")
        warmed = wait_all(self.warm_refs, WARM_TIMEOUT_S, stop)
        if len(warmed) < len(self.warm_refs):
            late = len(self.warm_refs) - len(warmed)
            raise SparesUnusable(f"{late} spare(s) still importing after {WARM_TIMEOUT_S:g}s")
        pings = [a.info.remote() for a in self.actors]
        answered = wait_all(pings, SPARE_ANSWER_S, stop)
        if len(answered) < len(pings):
            raise SparesUnusable(
                f"{len(pings) - len(answered)} spare(s) did not answer within {SPARE_ANSWER_S:g}s"
            )
        try:
            results, reports = ray.get(self.warm_refs), ray.get(pings)
        except ray.exceptions.RayError as e:
            raise SparesUnusable(f"a spare died: {first_line(e)}") from None
        cuda = [r for r, w in enumerate(results) if w["cuda_initialized"]]
        if cuda:
            from ...core.topology import format_rank_ranges

            where = next((w["cuda_initialized_at"] for w in results if w.get("cuda_initialized_at")), None)
            raise SparesUnusable(
                f"importing initialized CUDA in the spare(s) of rank(s) {format_rank_ranges(cuda)}"
                f"{f' (at {where})' if where else ''}, which would leave a context on the node's first GPU"
            )
        self.state = SpareState.ADOPTED
        return [dataclasses.replace(r, gpu_ids=ids) for r, ids in zip(reports, self.gpu_ids, strict=True)]

    def without(self, nodes: set[str], gpus_per_node: int) -> SparePool:
        """With --nodes MIN:MAX after a lost node: the spares of the other nodes, their ranks numbered
        again in node order (the gang gives each its new env on adoption); those on `nodes` are killed
        and their groups removed."""
        gone = {s.group for s in self.slots if s.node_id in nodes}
        kill_actors([a for a, s in zip(self.actors, self.slots, strict=True) if s.group in gone])
        placement.remove_groups([g for i, g in enumerate(self.groups) if i in gone])
        kept = (s for s in self.slots if s.group not in gone)
        left = order_nodes({NodeSlot(s.group, s.node_ip, s.node_id, s.hostname) for s in kept})  # old index
        new_slots = assign_ranks(renumbered(left), gpus_per_node)
        spare_at = {(s.group, s.bundle): i for i, s in enumerate(self.slots)}  # by old group and bundle
        order = [spare_at[(left[s.group].group, s.bundle)] for s in new_slots]
        self.groups = [self.groups[n.group] for n in left]
        self.slots = new_slots
        self.actors = [self.actors[i] for i in order]
        self.warm_refs = [self.warm_refs[i] for i in order]
        self.gpu_ids = [self.gpu_ids[i] for i in order]
        self.replaces_pids = [self.replaces_pids[i] for i in order]
        return self

    def discard(self, *, groups: bool) -> None:
        """Kill the spares; with `groups`, remove the placement groups too (they were handed over)."""
        self.state = SpareState.DISCARDED
        kill_actors(self.actors)
        if groups:
            placement.remove_groups(self.groups)
