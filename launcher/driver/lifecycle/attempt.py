"""One run of every rank: a rank gang (driver/gang/gang.py) with its output relay (driver/output/relay.py)
and, while restarts are left, the warm spares of the next attempt (driver/gang/spares.py), looked at by a
`Supervision` (driver/supervision/supervise.py). It has a method for each state of the controller
(driver/lifecycle/controller.py), and a teardown that ends it whatever state it reached: every actor killed,
every placement group removed (unless handed to the next attempt with its spares)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import ray

from ...core.elastic import Evict, GrowTo
from ...core.errors import RankFailedError
from ...core.metrics import MetricsMode, rank_labels
from ...core.outcome import LaunchResult
from ...core.poll import AllReturned, PollStatus, RanksFailed
from ...core.spec import LaunchSpec
from ...core.target import Target
from ..gang.gang import RankGang
from ..gang.rank_view import env_records
from ..gang.sources import PlaceRequest
from ..gang.spares import SparePool
from ..output.relay import OutputRelay, open_sink
from ..supervision.evict import EvictWatch
from ..supervision.grow import GrowWatch
from ..supervision.rank_ends import failed_on_their_own
from ..supervision.stragglers import StragglerWatch
from ..supervision.supervise import Supervision
from .context import AttemptTarget, LaunchContext
from .registry import runner_for
from .states import Placing

log = logging.getLogger("megaray")

SPARES_AFTER_S = 30.0  # spares start at the first progress report, or this long after the ranks


def import_ahead(actors: list, target: Target) -> list:
    """Each rank imports what its program will (the target's warm imports, with the env it has now)
    while the driver waits for the preflight's verdict; the program's run queues behind it in the
    actor. An import that fails is left to the program, which reports it. Returns the calls."""
    runner = runner_for(target)
    steps = runner.warm_imports(target)
    log.info("the ranks import %s while the preflight runs", ", ".join(steps))
    return [a.warm.remote({}, steps, own_program_next=True, prepare=(runner, target)) for a in actors]


def relay_for(ctx: LaunchContext, spec: LaunchSpec, gang: RankGang) -> OutputRelay:
    """A placed gang's output relay (the pool's sink when the pool was taken), with its straggler
    watch (driver/supervision/stragglers.py), which scores into the job's metrics when they are on."""
    stragglers = StragglerWatch(
        ctx.run.path,
        [f"{s.node_ip} ({s.hostname})" for s in gang.slots],
        on_scores=ctx.metrics.scores if spec.metrics is not MetricsMode.OFF else None,
        goodput=ctx.progress.goodput,
    )
    nodes = [s.node_rank for s in gang.slots]
    sink = open_sink(f"{gang.name}-output", ctx.run.path, nodes, spec.console_ranks, gang.pool_sink)
    return OutputRelay(sink, spec.console_ranks, ctx.progress, stragglers)


def evict_watch(ctx: LaunchContext, gang: RankGang, relay: OutputRelay) -> EvictWatch:
    """Whether to drop a slow node (driver/supervision/evict.py), from the relay's straggler watch."""
    names = {s.node_id: f"{s.node_ip} ({s.hostname})" for s in gang.slots}
    return EvictWatch(ctx.scaling, relay.stragglers, [s.node_id for s in gang.slots], names)


class Attempt:
    """One run of every rank: a gang, its output relay, and the next attempt's warm spares."""

    def __init__(self, ctx: LaunchContext, placing: Placing, target: AttemptTarget | None = None):
        """The attempt of the launch `ctx` that `placing` describes (its number, the failed attempt's
        warm spares, whether it grows, the nodes kept off: driver/lifecycle/controller.py); `target`:
        what it runs (driver/lifecycle/context.py)."""
        self.ctx, self.number, self.stop = ctx, (number := placing.number), ctx.stop
        target = target or AttemptTarget()
        known = target.known is not None
        self.spec = spec = dataclasses.replace(ctx.spec, target=target.known) if known else ctx.spec
        self.target = target.later or (lambda gpu_gib, ready: spec.target)
        self.imports_first = target.imports_first
        self.grow: GrowWatch | None = None  # once placed below MAX nodes
        self.evict: EvictWatch | None = None  # once placed
        name = spec.job_name if number == 0 else f"{spec.job_name}-a{number}"
        # kept off: a node that answers again is taken off (its GrowWatch), one found lost is added
        self.avoid, self.evicted = set(placing.avoid), placing.evicted
        away = placing.avoid | placing.evicted
        ask = PlaceRequest(name, number, ctx.cluster.fixed_size, away, ctx.scaling, placing.growing)
        self.gang = RankGang(spec, ctx.stop, ctx.profile, ask)
        self.spares_in = placing.spares  # given by the failed attempt, until adopted or discarded
        self.spares_out: SparePool | None = None  # started for the next attempt
        self.handed_over = False
        self.relay: OutputRelay | None = None
        self.refs: list = []  # each rank's run, by rank
        self.supervision: Supervision | None = None  # once the ranks run
        self.returns: tuple[Any, ...] = ()
        self.succeeded = False
        self.failure: RankFailedError | None = None
        self._imports: Any = None  # rank 0's imports ahead, until what they took is recorded

    @property
    def adopted(self) -> bool:
        return self.gang.adopted

    @property
    def lost_nodes(self) -> frozenset[str]:
        """The nodes the next attempt keeps off (final once torn down)."""
        return frozenset(self.avoid)

    @property
    def timings(self) -> dict[str, float]:
        return self.gang.timings

    # -- one method per state of the controller (driver/lifecycle/controller.py) ----------------------------
    def place(self) -> None:
        """Placement groups, or the warm spares / warm pool taken over; then the output relay."""
        spares_in, self.spares_in = self.spares_in, None
        gang = self.gang
        gang.place(spares_in)
        self.spec = gang.spec  # with --nodes MIN:MAX, on as many nodes as it was placed on
        if self.ctx.scaling.can_grow(self.spec.nodes):
            held = {s.node_id for s in gang.slots} | self.evicted  # evicted: never grown onto
            self.grow = GrowWatch(self.spec, self.ctx.scaling, held, self.avoid)
        self.relay = relay_for(self.ctx, self.spec, gang)
        self.evict = evict_watch(self.ctx, gang, self.relay)

    def start(self) -> None:
        """Every rank's actor, port and env, recorded in the run directory; then the program starts
        (the first attempt's once the preflight's verdict is in: its ranks import meanwhile)."""
        spec, gang = self.spec, self.gang
        where = [(s.node_id, s.node_ip) for s in gang.slots]
        on = spec.metrics is not MetricsMode.OFF
        known = on and not self.imports_first  # else the layout comes with the verdict, below
        dims = self.ctx.parallel_dims(spec) if known else None
        labels = rank_labels(spec.job_name, spec.metrics, where, dims, spec.peak_tflops)
        self.ctx.metrics.attempt(spec.world_size, spec.nodes, labels)
        self.ctx.progress.world_size = spec.world_size  # TFLOP/s per GPU of this attempt's GPUs
        try:
            outputs = self.relay.forward_from({s.node_id for s in gang.slots}, labels if on else None)
            envs = gang.start(self.relay.sink, outputs)
        except RankFailedError as e:  # a node lost while the ranks started
            self.failure = e
            raise
        size, asked = (gang.placed.size if gang.placed is not None else None), self.ctx.scaling.asked
        nodes = {"asked": str(asked), "running": size.nodes, "why": size.describe(asked)} if size else None
        self.ctx.run.write_topology(gang.master, [dataclasses.asdict(r) for r in gang.ranks], nodes)
        self.ctx.run.write_env(env_records(gang.handles, envs))
        # rank 0's process, with the target's stack imported (a warm pool's) or once it has (`after`)
        ready = (gang.actors[0], None) if gang.adopted else None
        if self.imports_first and not gang.adopted:
            self._imports = import_ahead(gang.actors, spec.target)[0]
            ready = (gang.actors[0], self._imports)
        gpu_gib = min((r.gpu_memory_gib for r in gang.reports if r.gpu_memory_gib), default=None)
        self.spec = spec = dataclasses.replace(spec, target=self.target(gpu_gib, ready))
        if on and not known and (dims := self.ctx.parallel_dims(spec)) is not None:
            labels = rank_labels(spec.job_name, spec.metrics, where, dims, spec.peak_tflops)
            self.ctx.metrics.attempt(spec.world_size, spec.nodes, labels)
            for node, forwarder in outputs.items():
                forwarder.relabel.remote(labels[node])
        self.refs = gang.run(spec.target, spec.cwd)
        gang.mark("started")

    def poll(self) -> PollStatus:
        """One look at the running ranks (up to a quarter of a second): still running, every rank
        returned, a failure or a hang, or time to grow."""
        if self.supervision is None:
            self.supervision = Supervision(
                self.gang.ends,
                self.refs,
                relay=self.relay,
                hang_timeout_s=self.spec.hang_timeout_s,
                checks=self._checks,
            )
        status = self.supervision.poll()
        match status:
            case AllReturned(returns):
                self.returns = returns
                self.gang.mark("finished")
            case RanksFailed(failure):
                self.failure = failure
        return status

    def finish(self) -> LaunchResult:
        """Every rank's process ends as a Python process does; one dying on its way out is a failure
        (its exit status, under torchrun)."""
        spec, gang = self.spec, self.gang
        try:
            gang.exit_gracefully(spec.exit_grace_s)
        except RankFailedError as e:
            self.failure = e
            raise
        self.succeeded = True
        self.relay.catch_up()  # what the ranks printed last (on their way out too), before the last word
        log.info("all %d ranks finished in %.1f s", spec.world_size, gang.timings["finished"])
        return LaunchResult(
            spec.job_name, spec.world_size, *gang.master, gang.ranks, self.returns, gang.timings
        )

    def _checks(self) -> RanksFailed | GrowTo | Evict | None:
        """Every turn of the supervision: a stop signal (raises Interrupted), the nodes still answer,
        the next attempt's spares tended, below MAX nodes whether to grow, whether to drop a slow node."""
        self.stop.check()
        if (failure := self.gang.ends.check_nodes()) is not None:
            return RanksFailed(failure)
        self._imported()
        self.ctx.metrics.progress(self.ctx.progress.stats)
        self._tend_spares()
        saved, grow = self.relay.last_checkpoint_at, self.grow
        found = grow.check(saved) if grow is not None else None
        return found or self.evict.check(self.spec.nodes, grow.room if grow is not None else 0, saved)

    def _imported(self) -> None:
        """Once rank 0's imports ahead are done, what they took (and the config built ahead), said
        and kept in summary.json (`timings.imports_s`): the part of a cold start that is the program's
        own, beside what the launch took before it (`timings.started` counts from the placing)."""
        if self._imports is None or not ray.wait([self._imports], timeout=0)[0]:
            return
        ref, self._imports = self._imports, None
        with contextlib.suppress(Exception):  # the rank failed: its run says why
            done = ray.get(ref)
            self.gang.timings["imports_s"] = done["seconds"]
            built = f" (the config built ahead in {done['prepared_s']:.1f} s)" if done["prepared_s"] else ""
            log.info("rank 0 imported its program's stack in %.1f s%s", done["seconds"], built)

    def _tend_spares(self) -> None:
        """Start the next attempt's spares once this one trains (before, they would compete with its
        ranks' imports) and tend them; while they import, nobody is named slow (stragglers.py `hold`)."""
        spec, gang = self.spec, self.gang
        due = self.relay.progress_seen or gang.since("started") >= SPARES_AFTER_S
        if self.spares_out is None and spec.spares and self.number < spec.max_restarts and due:
            self.spares_out = gang.start_spares(f"{spec.job_name}-a{self.number + 1}")
        if self.spares_out is not None:
            self.spares_out.tend(self.number + 1)
            self.relay.stragglers.hold(self.spares_out.warming)

    def hand_over(self) -> SparePool | None:
        """After a failure: the spares for the next attempt, which keeps the groups too."""
        pool = self.spares_out.hand_over() if self.spares_out is not None else None
        self.handed_over = pool is not None
        return pool

    def teardown(self) -> None:
        """Ranks still running (a peer failed, a hang, Ctrl-C) get SIGTERM and --kill-grace to end on
        it, as torchrun's do; then every actor is killed and the groups removed (unless handed over)."""
        if self.relay is not None:
            self.relay.nodes_lost(self.gang.lost_nodes)
        if not self.succeeded and self.refs and self.relay is not None:
            self.relay.stop_ranks()
            frozen = self.failure.beyond_signals() if self.failure is not None else set()
            self.gang.wait_stopped(self.refs, self.spec.kill_grace_s, frozen)
            if self.failure is not None:  # every rank that failed before the stop is listed (#45)
                listed = {f.rank for f in self.failure.failures}
                late = [f for f in failed_on_their_own(self.gang.handles, self.refs) if f.rank not in listed]
                if late:
                    self.failure.amend([*self.failure.failures, *late])
        self.gang.teardown(keep_groups=self.handed_over)
        self.avoid |= self.gang.lost_nodes
        if not self.succeeded and self.relay is not None and self.relay.sink is not None:
            self.gang.ends.last_words(self.failure)  # what the ranks printed last
        if self.spares_in is not None:  # given, but stopped before adopting them
            self.spares_in.discard(groups=True)
        if self.spares_out is not None and not self.handed_over:
            self.spares_out.discard(groups=False)
        if self.relay is not None:
            self.relay.finish()
        else:
            self.ctx.progress.close()
