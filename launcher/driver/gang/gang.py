"""The ranks of one launch attempt (or of a rank group), as one object: their placement groups, one
actor per rank, the rendezvous port and each rank's env, run and watched together, torn down together.

The order of a start is fixed: place (or take over warm spares, or share a host gang's bundles),
start the actors, probe and reserve MASTER_PORT on the master node, decide every rank's env (pure,
core/rankenv.py) and apply it in each actor before the target imports anything.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import ray

from ...core.errors import (
    ClusterError,
    Interrupted,
    MegarayError,
    RankFailedError,
    ResourceError,
    UsageError,
)
from ...core.rankenv import EnvDecision, decide_envs, startup_env
from ...core.spec import LaunchSpec
from ...core.target import Target
from ...core.topology import (
    RankInfo,
    RankReport,
    RankSlot,
)
from ..cluster.cluster import check_versions
from ..lifecycle.registry import runner_for
from ..lifecycle.stop import StopSignal
from ..output.shipping import spool_path
from ..supervision.exits import exit_gracefully
from ..supervision.liveness import NodeProbes, raylet_addresses
from ..supervision.rank_ends import RankEnds, fail_if_lost, node_lost, silent
from . import placement, ports
from .actors import first_line, kill_actors, start_rank_actor, wait_all
from .handle import RankHandle
from .links import check_rendezvous
from .rank_view import log_env, log_topology
from .sources import Placed, PlaceRequest, rank_sources
from .spares import SparePool

log = logging.getLogger("megaray")

ACTOR_START_TIMEOUT_S = 300.0  # covers runtime-env set-up and image pulls on first use of a node


def announce(spec: LaunchSpec) -> None:
    elastic = spec.node_range.elastic
    log.info(
        "job %s: %s node(s) x %d rank(s) = %s, target: %s",
        spec.job_name, spec.node_range, spec.gpus_per_node,
        f"{spec.node_range.min * spec.gpus_per_node}-{spec.world_size}" if elastic else spec.world_size,
        runner_for(spec.target).describe(spec.target),
    )  # fmt: skip


def sized(spec: LaunchSpec, placed: Placed) -> LaunchSpec:
    """The spec of an attempt of `--nodes MIN:MAX`: on the nodes its source gave it (said why)."""
    if placed.size is None:
        return spec
    log.info("job %s runs on %s", spec.job_name, placed.size.describe(spec.node_range))
    return spec.at_nodes(placed.size.nodes)


class RankGang:
    """Start with `place()` then `start()`; run with `run()` or `call()`; end with `teardown()`.

    `gpu_share` is the part of each rank's GPU and CPUs this gang's actors take; a gang created with
    `host=` another shares that gang's bundles, rank for rank (colocated rank groups).
    """

    def __init__(
        self, spec: LaunchSpec, stop: StopSignal, profile: dict[str, str], ask: PlaceRequest, *,
        gpu_share: float = 1.0, host: RankGang | None = None,
    ):  # fmt: skip
        """`ask`: where its ranks may come from (driver/gang/sources.py); `profile`: the EFA/NCCL
        variables every rank gets."""
        self.spec, self.stop, self.profile, self.ask = spec, stop, profile, ask
        self.name, self.attempt = ask.name, ask.attempt
        self.gpu_share, self.host = gpu_share, host
        # what every rank's process must have from its start (PYTHONHASHSEED, LD_PRELOAD, ...)
        self.start_env = startup_env(profile=profile, overrides=spec.env_overrides)
        self.placed: Placed | None = None  # where the ranks came from (driver/gang/sources.py)
        self.groups: list = []
        self.slots: list[RankSlot] = []
        self.actors: list = []
        self.reports: list[RankReport] = []
        self.handles: tuple[RankHandle, ...] = ()
        self.ends = RankEnds((), None)  # how the ranks end (driver/supervision/rank_ends.py), once started
        self.master: tuple[str, int] = ("", 0)
        self.port_reserved: tuple[str, int] | None = None
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def ranks(self) -> tuple[RankInfo, ...]:
        return tuple(h.info for h in self.handles)

    def mark(self, phase: str) -> None:
        self.timings[phase] = round(time.monotonic() - self.t0, 3)

    def since(self, phase: str) -> float:
        """Seconds since `phase` was marked."""
        return time.monotonic() - self.t0 - self.timings[phase]

    def start_spares(self, name: str) -> SparePool:
        """The next attempt's warm spares, one per rank in this gang's bundles (driver/gang/spares.py)."""
        return SparePool(name, self.spec, self.groups, self.handles, self.start_env)

    # -- start ------------------------------------------------------------------------------------
    @property
    def adopted(self) -> bool:
        """Its actors were running before this gang: the previous attempt's warm spares, or the pool's."""
        return self.placed is not None and self.placed.started

    @property
    def pool_sink(self) -> Any:
        """The output sink the warm pool started ahead on the driver's node, if the pool was taken."""
        return self.placed.sink if self.placed is not None else None

    def place(self, spares: SparePool | None = None) -> None:
        """A placement group per node, from the first source that gives one (driver/gang/sources.py): the
        spares' own when they can take over, the host gang's when colocated, the warm pool's, else new
        ones on distinct nodes."""
        spec = self.spec
        announce(spec)
        host = (self.host.groups, self.host.slots) if self.host is not None else None
        sources = rank_sources(spec, self.stop, self.ask, self.start_env, spares, host)
        placed = next(p for p in (source.take() for source in sources) if p is not None)
        self.spec = sized(spec, placed)
        self.placed, self.groups, self.slots = placed, placed.groups, placed.slots
        self.actors, self.reports = list(placed.actors), list(placed.reports)
        self.mark("placed")

    def start(self, sink: Any = None, outputs: Mapping[str, Any] | None = None) -> list[dict[str, str]]:
        """Actors (unless adopted), port, env; rank output goes to `sink` when given, through the
        forwarder of each rank's node (`outputs`, one for every node: driver/output/relay.py). Returns the
        whole environment each rank's process then has, by rank."""
        # a launch probes its nodes from here on; a rank group's calls are short: Ray's checks suffice
        probes = NodeProbes(raylet_addresses({s.node_id for s in self.slots})) if sink is not None else None
        self.ends = RankEnds((), None, probes)  # a node lost while the ranks start is lost to the launch
        if not self.adopted:
            self.actors, self.reports = self._start_actors(probes)
        self.mark("actors_ready")
        check_versions(self.reports)
        port, self.port_reserved = choose_port(self.spec, self.actors[0], self.slots[0].node_ip, self.name)
        master = (self.slots[0].node_ip, port)
        check_rendezvous(self.actors, self.slots, self.reports, master, self.stop)
        decisions = gang_envs(self.spec, self.slots, self.reports, master, self.attempt, self.profile)
        replaced = self.placed.replaced_pids or [None] * self.world_size
        self.handles = tuple(
            RankHandle(s, a, r, d, old, spool_path(r, self.name, s.rank) if sink is not None else None)
            for s, a, r, d, old in zip(
                self.slots, self.actors, self.reports, decisions, replaced, strict=True
            )
        )
        self.ends = RankEnds(self.handles, sink, probes, dict(outputs or {}) if sink is not None else None)
        envs = set_up(self.handles, outputs if sink is not None else None, self.adopted)
        self.mark("env_set")
        self.master = master
        log_topology(self.ranks, self.master)
        log_env(self.handles, self.spec, self.profile)
        return list(envs)

    def _start_actors(self, probes: NodeProbes | None) -> tuple[list, list[RankReport]]:
        """One actor per rank in its bundle, and what each reports once its process is up (a node
        that cannot start it, or runs another Ray or Python, fails here rather than at rendezvous; a
        node that stops answering the probes meanwhile fails its ranks as lost, in seconds)."""

        def nodes_answer() -> None:
            lost = probes.tick() if probes is not None else {}
            how = {n: silent(*seen, " while its ranks started") for n, seen in lost.items()}
            fail_if_lost(self.ends, self.slots, how)

        spec = self.spec
        actors = [
            start_rank_actor(
                None, self.groups[s.group], s.bundle, job=spec.job_name, rank=s.rank,
                node_ip=s.node_ip, num_cpus=spec.cpus_per_rank * self.gpu_share,
                num_gpus=self.gpu_share if spec.uses_gpus else 0, start_env=self.start_env,
            )
            for s in self.slots
        ]  # fmt: skip
        self.actors = actors  # so that a teardown during the wait kills them
        refs = [a.info.remote() for a in actors]
        ready = wait_all(refs, ACTOR_START_TIMEOUT_S, self.stop, nodes_answer)
        if len(ready) < len(refs):
            raise ResourceError(
                f"{len(refs) - len(ready)} of {len(refs)} rank actors did not start within "
                f"{ACTOR_START_TIMEOUT_S:g}s (runtime environment set-up?); check `ray status` and the "
                "raylet logs of their nodes"
            )
        try:
            return actors, ray.get(refs)
        except ray.exceptions.RayActorError as e:
            # not a node that cannot run megaray: one that went away meanwhile
            gone = [n for n in {s.node_id for s in self.slots} if node_lost(n)]
            fail_if_lost(self.ends, self.slots, dict.fromkeys(gone, "Ray lost it while its ranks started"))
            raise ClusterError(
                f"a rank actor failed to start: {first_line(e)}; is megaray installed on every node "
                "with the driver's Python?"
            ) from None

    # -- run and watch (the gang side of supervise.py) ---------------------------------------------
    def run(self, target: Target, cwd: str) -> list:
        runner = runner_for(target)
        return [a.run.remote(runner, target, cwd) for a in self.actors]

    def call(self, fn: Any, per_rank_args: list[tuple], kwargs: dict) -> list:
        return [a.call.remote(fn, args, kwargs) for a, args in zip(self.actors, per_rank_args, strict=True)]

    @property
    def lost_nodes(self) -> set[str]:
        return {node for node, gone in self.ends.lost.items() if gone}

    def exit_gracefully(self, grace_s: float) -> None:
        """After every rank returned: each process ends as a Python process does, watched on its
        node; one still running after `grace_s` is killed and named (rank_ends.py)."""
        for a in self.actors:
            a.leave.remote()  # rank/actor.py: output to its spool from here, then exit
        crashed = exit_gracefully(self.handles, self.ends.sink, self.ends.lingering, grace_s, self.stop,
                                  self.ends.forwarders())  # fmt: skip
        self.mark("exited")
        if crashed:
            raise RankFailedError(crashed, self.world_size)

    def wait_stopped(self, refs: list, grace_s: float, frozen: set[int] = frozenset()) -> None:
        """After a stop: give the ranks still running `grace_s` to end on their SIGTERM; not those on a
        lost node, which no signal reaches and whose end Ray tells only when it gives the node up, nor
        the `frozen` ranks, whose process cannot act on it (a SIGSTOPped rank waited out the grace).
        A rank is done when its call ends or its node sees its process gone, whichever comes first
        (Ray tells a death only when the children the rank forked let go of its socket)."""
        lost = self.lost_nodes
        alive = {
            ref: r.pid
            for ref, r in zip(refs, self.reports, strict=True)
            if r.node_id not in lost and r.rank not in frozen
        }

        def settled(pending: list) -> set:
            gone = self.ends.pids_gone()
            return {ref for ref in pending if alive[ref] in gone}

        with contextlib.suppress(Interrupted):  # a second Ctrl-C: kill at once
            wait_all(list(alive), grace_s, self.stop, settled=settled)

    # -- end --------------------------------------------------------------------------------------
    def teardown(self, *, keep_groups: bool = False) -> None:
        """Kill every rank; remove the groups unless they are kept (handed over with warm spares) or
        belong to the host gang; release the port."""
        self.ends.close()
        kill_actors(self.actors)
        if self.placed is not None and self.placed.owns_groups and not keep_groups:
            placement.remove_groups(self.groups)
        if self.port_reserved:
            ports.release(*self.port_reserved)
            self.port_reserved = None
        self.mark("torn_down")


def set_up(handles: tuple[RankHandle, ...], outputs: Mapping[str, Any] | None, adopted: bool) -> list[dict]:
    """Each rank's env set in its process, its output captured to its node's forwarder (`outputs`, by
    node; None: Ray streams it) and, for adopted processes (spares, the pool), its GPUs given; rank 0
    serves the store. Returns the whole environment each rank's process then has, by rank."""
    refs = [
        h.actor.setup.remote(
            h.env.to_set,
            outputs[h.slot.node_id] if outputs is not None else None,
            h.report.gpu_ids if adopted else None,
            h.replaces_pid,
            h.spool,
            h.slot.rank,
            host_store=h.slot.rank == 0,
        )
        for h in handles
    ]
    try:
        envs, took_over = zip(*ray.get(refs), strict=True)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, MegarayError):
            raise e.cause from None
        raise
    if any(took_over):
        log.info("the spares took over: %s", "; ".join(
            f"rank {r}: {how}" for r, how in enumerate(took_over) if how))  # fmt: skip
    return list(envs)


def choose_port(
    spec: LaunchSpec, rank0: Any, master_addr: str, name: str
) -> tuple[int, tuple[str, int] | None]:
    """A port free on the master node (probed there by rank 0), reserved cluster-wide; and the
    reservation to release at teardown (None when the port was asked for and is another's)."""
    found = ray.get(rank0.free_ports.remote(spec.job_name, 16, spec.master_port))
    if spec.master_port is not None and not found:
        raise UsageError(
            f"--master-port {spec.master_port} is in use on the master node {master_addr}; choose "
            "another port or leave --master-port out to pick a free one"
        )
    port = ports.reserve(master_addr, found, name)
    if port is not None:
        return port, (master_addr, port)
    if spec.master_port is not None:
        return spec.master_port, None  # asked for explicitly: another job's reservation does not bind it
    raise ResourceError(f"no free port for MASTER_PORT on {master_addr}; pass --master-port")


def gang_envs(
    spec: LaunchSpec, slots: list[RankSlot], reports: list[RankReport], master: tuple[str, int], attempt: int,
    profile: dict[str, str],
) -> list[EnvDecision]:  # fmt: skip
    return decide_envs(
        slots,
        [r.gpu_ids for r in reports],
        [r.inherited_env for r in reports],
        world_size=spec.world_size,
        local_world_size=spec.gpus_per_node,
        num_nodes=spec.nodes,
        master_addr=master[0],
        master_port=master[1],
        run_id=spec.job_name,
        restart_count=attempt,
        max_restarts=spec.max_restarts,
        profile=profile,
        profile_name=spec.env_profile,
        overrides=spec.env_overrides,
        forwarded=dict(spec.forwarded),
        ifaces=[r.iface for r in reports],
    )
