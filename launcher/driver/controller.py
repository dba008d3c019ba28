"""A launch's lifecycle as one state and one step (Ray Train v2's `TrainController` and torch
elastic's `WorkerState` do the same): placing -> starting -> running -> finishing -> succeeded, and on a
rank failure the failure policy's decision: restarting (back to placing, with the failed attempt's
warm spares) or failed. Ctrl-C/SIGTERM ends in interrupted, anything else in error.

Each state is one method of the attempt (driver/attempt.py); the controller calls it and moves on,
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

from ..core.elastic import GrowTo
from ..core.errors import RankFailedError
from ..core.outcome import LaunchObserver, LaunchState, Restart, RestartKind, run_outcome
from ..core.policy import FailureDecision, FailurePolicy
from .sources import RELAUNCH_SETTLE_S

log = logging.getLogger("megaray")

RELAUNCHED = "Every other rank was stopped; the whole group is relaunched (see below)."
REMOVED = "Every other rank was stopped and the placement groups were removed."


class AttemptLike(Protocol):
    """One run of every rank, a method per state; `adopted` once placed: it took over warm spares."""

    adopted: bool

    def place(self) -> None: ...

    def start(self) -> None: ...

    def watch(self) -> None: ...

    def finish(self) -> Any: ...

    def hand_over(self) -> Any: ...

    def teardown(self) -> None: ...


class Controller:
    """Runs attempts until one succeeds or the failure policy says fail; `state` is where the launch
    stands, `history` every state it went through, with when (wall clock)."""

    def __init__(
        self,
        policy: FailurePolicy,
        new_attempt: Callable[[int, Any, bool], AttemptLike],
        *,
        placement_timeout_s: float = 0.0,
        min_nodes: int | None = None,
        observers: tuple[LaunchObserver, ...] = (),
        clock: Callable[[], float] = time.time,
    ):
        self.policy, self.new_attempt, self.observers, self.clock = policy, new_attempt, observers, clock
        self.placement_timeout_s = placement_timeout_s
        self.min_nodes = min_nodes  # --nodes MIN:MAX: a relaunch goes on with fewer nodes, down to this
        self.state = LaunchState.PLACING
        self.history: list[tuple[LaunchState, float]] = [(self.state, clock())]
        self.number = 0  # the attempt's: 0, then one more per relaunch (a failure's or a grow's)
        self.failed = 0  # relaunches after a failure, what --max-restarts counts
        self.attempt: AttemptLike | None = None  # the current one, until torn down
        self.last_attempt: AttemptLike | None = None
        self.restarts: list[Restart] = []
        self.result: Any = None
        self._spares: Any = None  # the failed attempt's, for the next one
        self._growing = False  # the next attempt is a grow's relaunch
        self._failure: RankFailedError | None = None

    def run(self) -> Any:
        """Step until the launch ends; return what the succeeding attempt returned, or raise what
        ended it (the attempt torn down first)."""
        steps = {
            LaunchState.PLACING: self._place,
            LaunchState.STARTING: self._start,
            LaunchState.RUNNING: self._watch,
            LaunchState.FINISHING: self._finish,
            LaunchState.RESTARTING: self._restart,
        }
        try:
            while not self.state.ended:
                try:
                    state = steps[self.state]()
                except RankFailedError as e:
                    state = self._decide(e)
                except GrowTo as e:
                    state = self._grow(e)
                self._move(state)
        except BaseException as e:
            self._close()
            self._move(run_outcome(e).status)
            raise
        if self.state is LaunchState.FAILED:
            raise self._failure
        return self.result

    def _move(self, state: LaunchState) -> None:
        if state is not self.state:
            log.debug("launch: %s -> %s", self.state, state)
            self.state = state
            self.history.append((state, self.clock()))
            for observer in self.observers:
                observer.on_state(state)

    # -- one method per state, each returning the next ---------------------------------------------
    def _place(self) -> LaunchState:
        spares, self._spares = self._spares, None
        growing, self._growing = self._growing, False
        self.attempt = self.last_attempt = self.new_attempt(self.number, spares, growing)
        self.attempt.place()
        return LaunchState.STARTING

    def _start(self) -> LaunchState:
        self.attempt.start()
        return LaunchState.RUNNING

    def _watch(self) -> LaunchState:
        self.attempt.watch()
        return LaunchState.FINISHING

    def _finish(self) -> LaunchState:
        self.result = self.attempt.finish()
        self._close()
        return LaunchState.SUCCEEDED

    def _decide(self, failure: RankFailedError) -> LaunchState:
        """A rank failed in any state of the attempt: the policy says what follows. A restart takes the
        spares over before the teardown; the teardown adds the dead ranks' last output to `failure`."""
        self._failure = failure
        for observer in self.observers:
            observer.on_failure(failure)
        decision = self.policy.decide(failure, self.failed)
        if decision is FailureDecision.RESTART:
            self.failed += 1
            self._spares = self.attempt.hand_over()
        self._close()
        if decision is FailureDecision.FAIL:
            failure.ending = REMOVED
            return LaunchState.FAILED
        failure.ending = RELAUNCHED
        print(failure.report(), file=sys.stderr, flush=True)
        self._restarted(Restart(self.number + 1, str(failure), self.clock()))
        how = f"waiting up to {self.placement_timeout_s:g}s for the layout to fit"
        if self.min_nodes is not None:
            how = f"on the nodes that hold a group within {RELAUNCH_SETTLE_S:g}s, at least {self.min_nodes}"
        how = "on the warm spares" if self._spares else how
        log.warning(
            "restart %d of %d after: %s; relaunching every rank (%s)",
            self.failed, self.policy.max_restarts, failure, how,
        )  # fmt: skip
        return LaunchState.RESTARTING

    def _grow(self, grow: GrowTo) -> LaunchState:
        """Running below MAX nodes, the cluster has room for more: every rank is stopped and relaunched
        on them (not a failure: --max-restarts does not count it)."""
        self._restarted(Restart(self.number + 1, grow.why, self.clock(), kind=RestartKind.GROW))
        log.warning("%s; relaunching every rank on up to %d node(s)", grow.why, grow.nodes)
        self._growing = True
        self._close()
        return LaunchState.RESTARTING

    def _restarted(self, restart: Restart) -> None:
        self.restarts.append(restart)
        for observer in self.observers:
            observer.on_restart(restart)

    def _restart(self) -> LaunchState:
        self.number += 1
        return LaunchState.PLACING

    def _close(self) -> None:
        """Tear the current attempt down, once; a relaunch's record says whether it ran on the spares."""
        attempt, self.attempt = self.attempt, None
        if attempt is None:
            return
        attempt.teardown()
        if self.number:
            self.restarts[self.number - 1].warm_spares = attempt.adopted
