"""A launch's lifecycle as one state and one step (Ray Train v2's `TrainController` and torch
elastic's `WorkerState` do the same): placing -> starting -> running -> finishing -> succeeded, and on a
rank failure the failure policy's decision: restarting (back to placing, with the failed attempt's
warm spares) or failed. Ctrl-C/SIGTERM ends in interrupted, anything else in error.

Each state is an object that carries what it needs (driver/lifecycle/states.py), as Ray Train
v2's `RestartingState` carries its failure: placing the attempt's number and the spares it takes
over, restarting the relaunch and what goes with it, the ends the result or the failure. Each step
is one method of the attempt (driver/lifecycle/attempt.py); the controller calls it and moves on,
so every transition is tested against a fake attempt (tests/test_controller_pure.py). Whatever the
ending, the attempt is torn down: every actor killed, every placement group removed, unless handed
to the next attempt with its spares.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from ...core.elastic import Evict, GrowTo
from ...core.errors import RankFailedError
from ...core.lifecycle import LaunchObserver, LaunchState, Restart, RestartKind
from ...core.outcome import run_outcome
from ...core.policy import FailureDecision, FailurePolicy
from ...core.poll import AllReturned, PollStatus, RanksFailed, StillRunning
from ..gang.sources import RELAUNCH_SETTLE_S
from .states import Ended, Failed, Finishing, Placing, Restarting, Running, Starting, Step, Succeeded

log = logging.getLogger("megaray")

RELAUNCHED = "Every other rank was stopped; the whole group is relaunched (see below)."
REMOVED = "Every other rank was stopped and the placement groups were removed."


class AttemptLike(Protocol):
    """One run of every rank, a method per state; `adopted` once placed: it took over warm spares;
    `lost_nodes` once torn down: the nodes the next attempt keeps off (those it was given, less any
    that answered again, and those it found lost)."""

    adopted: bool
    lost_nodes: frozenset[str]

    def place(self) -> None: ...

    def start(self) -> None: ...

    def poll(self) -> PollStatus: ...

    def finish(self) -> Any: ...

    def hand_over(self) -> Any: ...

    def teardown(self) -> None: ...


class Controller:
    """Runs attempts until one succeeds or the failure policy says fail; `step` is where the launch
    stands (`state` its name), `history` every state it went through, with when (wall clock)."""

    def __init__(
        self,
        policy: FailurePolicy,
        new_attempt: Callable[[Placing], AttemptLike],
        *,
        placement_timeout_s: float = 0.0,
        min_nodes: int | None = None,
        observers: tuple[LaunchObserver, ...] = (),
        clock: Callable[[], float] = time.time,
    ):
        self.policy, self.new_attempt, self.observers, self.clock = policy, new_attempt, observers, clock
        self.placement_timeout_s = placement_timeout_s
        self.min_nodes = min_nodes  # --nodes MIN:MAX: a relaunch goes on with fewer nodes, down to this
        self.step: Step = Placing(0)
        self.history: list[tuple[LaunchState, float]] = [(self.step.kind, clock())]
        self.number = 0  # the current attempt's: 0, then one more per relaunch (a failure's or a grow's)
        self.failed = 0  # relaunches after a failure, what --max-restarts counts
        self.attempt: AttemptLike | None = None  # the current one, until torn down
        self.last_attempt: AttemptLike | None = None
        self.restarts: list[Restart] = []
        self.evicted: frozenset[str] = frozenset()  # slow nodes dropped, kept off by every later attempt

    @property
    def state(self) -> LaunchState:
        return self.step.kind

    def run(self) -> Any:
        """Step until the launch ends; return what the succeeding attempt returned, or raise what
        ended it (the attempt torn down first)."""
        try:
            while not self.state.ended:
                try:
                    step = self._next(self.step)
                except RankFailedError as e:  # placing, starting or finishing: a node lost, a crash on exit
                    step = self._decide(e)
                self._move(step)
        except BaseException as e:
            self._close()
            self._move(Ended(run_outcome(e).status))
            raise
        if isinstance(self.step, Failed):
            raise self.step.failure
        assert isinstance(self.step, Succeeded)
        return self.step.result

    def _next(self, step: Step) -> Step:
        """The attempt's method for this state; what it returns, or raises, says the next. Running,
        the attempt is looked at once a turn (core/poll.py) until what it finds moves the launch on."""
        match step:
            case Placing(number) as placing:
                self.number = number
                self.attempt = self.last_attempt = self.new_attempt(placing)
                self.attempt.place()
                return Starting()
            case Starting():
                self.attempt.start()
                return Running()
            case Running():
                match self.attempt.poll():
                    case StillRunning():
                        return step
                    case AllReturned():
                        return Finishing()
                    case RanksFailed(failure):
                        return self._decide(failure)
                    case GrowTo() as grow:
                        return self._grow(grow)
                    case Evict() as evict:
                        return self._evict(evict)
            case Finishing():
                result = self.attempt.finish()
                self._close()
                return Succeeded(result)
            case Restarting(restart, spares, growing, avoid):
                return Placing(restart.attempt, spares, growing, avoid, self.evicted)
        raise AssertionError(f"no step from {step}")

    def _move(self, step: Step) -> None:
        previous, self.step = self.state, step
        if step.kind is not previous:
            log.debug("launch: %s -> %s", previous, step.kind)
            self.history.append((step.kind, self.clock()))
            for observer in self.observers:
                observer.on_state(step.kind)

    def _decide(self, failure: RankFailedError) -> Step:
        """A rank failed in any state of the attempt: the policy says what follows. A restart takes the
        spares over before the teardown; the teardown adds the dead ranks' last output to `failure`."""
        for observer in self.observers:
            observer.on_failure(failure)
        decision = self.policy.decide(failure, self.failed)
        spares = None
        if decision is FailureDecision.RESTART:
            self.failed += 1
            spares = self.attempt.hand_over()
        self._close()
        if decision is FailureDecision.FAIL:
            failure.ending = REMOVED
            return Failed(failure)
        failure.ending = RELAUNCHED
        print(failure.report(), file=sys.stderr, flush=True)
        restart = self._restarted(Restart(self.number + 1, str(failure), self.clock()))
        how = f"waiting up to {self.placement_timeout_s:g}s for the layout to fit"
        if self.min_nodes is not None:
            how = f"on the nodes that hold a group within {RELAUNCH_SETTLE_S:g}s, at least {self.min_nodes}"
        how = "on the warm spares" if spares else how
        log.warning(
            "restart %d of %d after: %s; relaunching every rank (%s)",
            self.failed, self.policy.max_restarts, failure, how,
        )  # fmt: skip
        return Restarting(restart, spares, avoid=self._avoid())

    def _grow(self, grow: GrowTo) -> Step:
        """Running below MAX nodes, the cluster has room for more: every rank is stopped and relaunched
        on them (not a failure: --max-restarts does not count it)."""
        restart = self._restarted(Restart(self.number + 1, grow.why, self.clock(), kind=RestartKind.GROW))
        log.warning("%s; relaunching every rank on up to %d node(s)", grow.why, grow.nodes)
        self._close()
        return Restarting(restart, growing=True, avoid=self._avoid())

    def _evict(self, evict: Evict) -> Step:
        """A node's rank stayed slow (--evict-stragglers): every rank is stopped and relaunched without
        that node, which no later attempt is placed on (not a failure: --max-restarts does not count
        it); the relaunch grows back onto another node once the cluster has room."""
        restart = self._restarted(Restart(self.number + 1, str(evict), self.clock(), kind=RestartKind.EVICT))
        log.warning("%s; relaunching every rank without it", evict)
        self.evicted |= {evict.node_id}
        self._close()
        return Restarting(restart, avoid=self._avoid())

    def _avoid(self) -> frozenset[str]:
        """What the next attempt keeps off: what the last one made (torn down by now) says."""
        return self.last_attempt.lost_nodes if self.last_attempt is not None else frozenset()

    def _restarted(self, restart: Restart) -> Restart:
        self.restarts.append(restart)
        for observer in self.observers:
            observer.on_restart(restart)
        return restart

    def _close(self) -> None:
        """Tear the current attempt down, once; a relaunch's record says whether it ran on the spares."""
        attempt, self.attempt = self.attempt, None
        if attempt is None:
            return
        attempt.teardown()
        if self.number:
            self.restarts[self.number - 1].warm_spares = attempt.adopted
