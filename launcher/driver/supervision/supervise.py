"""Looking at running ranks: the first failure ends the attempt, a silent job is a hang, a signal stops.

`Supervision.poll` looks once (up to POLL_S) and says what it found, typed (core/poll.py): the
controller decides from it each turn (driver/lifecycle/controller.py). `supervise` polls until the end, for a
rank group's calls. Written against two small interfaces, so that the rules (which failure is the
root cause, when silence counts as a hang, how a stop signal is seen) are tested with a fake gang
and a fake clock:

- the ranks (driver/supervision/rank_ends.py `RankEnds`): `world_size`, `wait(refs, num_returns, timeout_s) ->
  (done, pending)`, `outcome(ref, rank) -> (ok, value or RankFailure)`, `inspect_hang(idle_s) ->
  [RankFailure]`;
- the relay (rank output), optional: `pump(wait_s)`, `news()` (a ref ready once the sink has
  something to show, waited for beside the ranks' ends), `writes_seen`, `last_activity`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from ...core.elastic import Evict, GrowTo
from ...core.errors import RankFailedError, RankFailure, peer_consequence
from ...core.poll import AllReturned, PollStatus, RanksFailed, StillRunning
from ..lifecycle.stop import StopSignal

ROOT_CAUSE_WINDOW_S = 0.1  # failures arriving this close together are compared to find the first
# When every failure so far is a peer's connection error, how long to wait for the end that caused
# it (a process or node gone, told by Ray or megaray's probes: core/liveness.py, about 4 s)
PEER_WAIT_S = 6.0
STARTUP_GRACE_S = 120.0  # the least silence allowed before the first line of any rank
POLL_S = 0.25  # how often the loop looks at signals, output and the hang timer


class Gang(Protocol):
    world_size: int

    def wait(self, refs: list, num_returns: int, timeout_s: float) -> tuple[list, list]: ...

    def outcome(self, ref: Any, rank: int) -> tuple[bool, Any]: ...

    def inspect_hang(self, idle_s: float) -> list[RankFailure]: ...


class Relay(Protocol):
    writes_seen: int
    last_activity: float

    def pump(self, wait_s: float = 0.0) -> None: ...

    def news(self) -> Any: ...


def hang_limit(hang_timeout_s: float, any_output: bool) -> float:
    """Before any rank has printed (imports, rendezvous), a short --hang-timeout is not enough."""
    return hang_timeout_s if any_output else max(hang_timeout_s, STARTUP_GRACE_S)


Checks = Callable[[], RanksFailed | GrowTo | Evict | None]


class Supervision:
    """One call per rank (`refs`, by rank), looked at one turn at a time.

    The first failure ends it at once: the others would hang in collectives. Peers of a dead rank
    fail a moment later with connection errors, so what arrives within a short window is gathered
    too, and the root cause is the rank that failed first. No output or progress from any rank for
    `hang_timeout_s` (0: never) is a hang: every rank's state and stack are read and the attempt
    fails the same way. `checks` runs on every turn (a stop signal, the nodes' liveness, the warm
    spares, growing) and may end it: with what it found, or by raising (Interrupted).
    """

    def __init__(
        self, gang: Gang, refs: list, *, relay: Relay | None = None, hang_timeout_s: float = 0.0,
        checks: Checks = lambda: None, clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        self.gang, self.relay, self.checks, self.clock = gang, relay, checks, clock
        self.hang_timeout_s = hang_timeout_s
        self.rank_of = {ref: r for r, ref in enumerate(refs)}
        self.returns: list[Any] = [None] * len(refs)
        self.failures: list[RankFailure] = []
        self.pending = list(refs)
        self.started = clock()

    def poll(self) -> PollStatus:
        """One turn: signals, output, the checks, the hang timer, then up to POLL_S for a rank to end."""
        gang, relay = self.gang, self.relay
        if not self.pending:
            return AllReturned(tuple(self.returns))
        if (found := self.checks()) is not None:
            return found
        if relay is not None:
            relay.pump()
        if self.hang_timeout_s and relay is not None:
            idle = self.clock() - max(self.started, relay.last_activity)
            if idle > hang_limit(self.hang_timeout_s, relay.writes_seen > 0):
                hung = gang.inspect_hang(idle)
                if any("faulthandler" in f.summary for f in hung):
                    relay.pump(wait_s=2.0)  # their stacks reach the rank logs through the sink
                return RanksFailed(RankFailedError(hung, gang.world_size))
        done = self._wait(POLL_S)
        if not done:
            return StillRunning()
        if self.pending:  # every call ready by now, in one pass: at the end of a run they all are at once
            more, self.pending = gang.wait(self.pending, len(self.pending), 0)
            done = [*done, *more]
        self._collect(done)
        if not self.failures:
            return StillRunning() if self.pending else AllReturned(tuple(self.returns))
        if self.pending:
            more, self.pending = gang.wait(self.pending, len(self.pending), ROOT_CAUSE_WINDOW_S)
            self._collect(more)
        told = self._wait_for_the_cause()
        if relay is not None:
            relay.pump(wait_s=2.0)  # the failing rank's last lines before the report
        return RanksFailed(RankFailedError([*told, *self.failures], gang.world_size))

    def _wait(self, timeout_s: float) -> list:
        """Up to `timeout_s` for a rank to end; what the sink has to show meanwhile is shown as it
        comes (the relay's long-poll drain, waited for with the ranks), so a line waits for no turn."""
        deadline = self.clock() + timeout_s
        while True:
            news = self.relay.news() if self.relay is not None else None
            refs = self.pending if news is None else [*self.pending, news]
            done, _ = self.gang.wait(refs, 1, max(0.0, deadline - self.clock()))
            if news is not None and news in done:
                done.remove(news)
                self.relay.pump()
            if done or self.clock() >= deadline:
                ended = set(done)
                self.pending = [ref for ref in self.pending if ref not in ended]
                return done

    def _collect(self, done: list) -> None:
        for ref in done:
            ok, value = self.gang.outcome(ref, self.rank_of[ref])
            if ok:
                self.returns[self.rank_of[ref]] = value
            else:
                self.failures.append(value)

    def _wait_for_the_cause(self) -> list[RankFailure]:
        """While every failure is a peer's connection error (a gloo "Connection reset by peer" within
        a moment of another rank's process or node going), wait up to PEER_WAIT_S for what ended:
        another rank's failure, or the node checks (a lost node or an ending process), whose
        failures are returned to come first. Growing is not looked for: the attempt failed."""
        deadline = self.clock() + PEER_WAIT_S
        while self.pending and all(map(peer_consequence, self.failures)) and self.clock() < deadline:
            if isinstance(found := self.checks(), RanksFailed):
                return list(found.failure.failures)
            done, self.pending = self.gang.wait(self.pending, 1, POLL_S)
            self._collect(done)
        return []


def supervise(
    gang: Gang,
    refs: list,
    stop: StopSignal,
    *,
    relay: Relay | None = None,
    hang_timeout_s: float = 0.0,
    checks: Callable[[], RanksFailed | None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Any, ...]:
    """Poll a Supervision until every rank returned (their values, by rank), or raise the first
    failure as RankFailedError (a rank group's calls: driver/gang/group.py); a stop signal raises."""

    def stop_then_checks() -> RanksFailed | None:
        stop.check()
        return checks()

    watch = Supervision(
        gang, refs, relay=relay, hang_timeout_s=hang_timeout_s, checks=stop_then_checks, clock=clock
    )
    while True:
        match watch.poll():
            case StillRunning():
                continue
            case AllReturned(returns):
                return returns
            case RanksFailed(failure):
                raise failure
            case other:
                raise AssertionError(f"{other} from checks that cannot grow")
