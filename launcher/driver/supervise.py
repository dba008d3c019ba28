"""Watching running ranks: the first failure ends the attempt, a silent job is a hang, a signal stops.

Written against two small interfaces, so that the rules (which failure is the root cause, when
silence counts as a hang, how a stop signal is seen) are tested with a fake gang and a fake clock:

- the gang: `world_size`, `wait(refs, num_returns, timeout_s) -> (done, pending)`,
  `outcome(ref, rank) -> (ok, value or RankFailure)`, `inspect_hang(idle_s) -> [RankFailure]`;
- the relay (rank output), optional: `pump(wait_s)`, `writes_seen`, `last_activity`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from ..core.errors import RankFailedError, RankFailure, peer_consequence
from .stop import StopSignal

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


def hang_limit(hang_timeout_s: float, any_output: bool) -> float:
    """Before any rank has printed (imports, rendezvous), a short --hang-timeout is not enough."""
    return hang_timeout_s if any_output else max(hang_timeout_s, STARTUP_GRACE_S)


def supervise(
    gang: Gang,
    refs: list,
    stop: StopSignal,
    *,
    relay: Relay | None = None,
    hang_timeout_s: float = 0.0,
    tick: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Any, ...]:
    """Wait for one call per rank (`refs`, by rank) and return their values, by rank.

    The first failure raises RankFailedError at once: the others would hang in collectives. Peers of
    a dead rank fail a moment later with connection errors, so what arrives within a short window is
    gathered too, and the error's root cause is the rank that failed first. No output or progress
    from any rank for `hang_timeout_s` (0: never) is a hang: every rank's state and stack are read
    and the attempt fails the same way. `tick` runs on every turn (the warm spares are tended there).
    """
    rank_of = {ref: r for r, ref in enumerate(refs)}
    returns: list[Any] = [None] * len(refs)
    failures: list[RankFailure] = []
    pending = list(refs)
    started = clock()

    def collect(done: list) -> None:
        for ref in done:
            ok, value = gang.outcome(ref, rank_of[ref])
            if ok:
                returns[rank_of[ref]] = value
            else:
                failures.append(value)

    while pending:
        stop.check()
        if relay is not None:
            relay.pump()
        tick()
        if hang_timeout_s and relay is not None:
            idle = clock() - max(started, relay.last_activity)
            if idle > hang_limit(hang_timeout_s, relay.writes_seen > 0):
                hung = gang.inspect_hang(idle)
                if any("faulthandler" in f.summary for f in hung):
                    relay.pump(wait_s=2.0)  # their stacks reach the rank logs through the sink
                raise RankFailedError(hung, gang.world_size)
        done, pending = gang.wait(pending, 1, POLL_S)
        if not done:
            continue
        if pending:  # every call ready by now, in one pass: at the end of a run they all are at once
            more, pending = gang.wait(pending, len(pending), 0)
            done = [*done, *more]
        collect(done)
        if failures:
            if pending:
                more, pending = gang.wait(pending, len(pending), ROOT_CAUSE_WINDOW_S)
                collect(more)
            _wait_for_the_cause(gang, pending, failures, collect, tick, stop, clock)
            if relay is not None:
                relay.pump(wait_s=2.0)  # the failing rank's last lines before the report
            raise RankFailedError(failures, gang.world_size)
    return tuple(returns)


def _wait_for_the_cause(
    gang: Gang, pending: list, failures: list[RankFailure], collect: Callable[[list], None],
    tick: Callable[[], None], stop: StopSignal, clock: Callable[[], float],
) -> None:  # fmt: skip
    """While every failure is a peer's connection error (a gloo "Connection reset by peer" within a
    moment of another rank's process or node going), wait up to PEER_WAIT_S for what ended: another
    rank's failure, or the node checks in `tick` (which raise for a lost node or an ending process;
    their failures then come with these)."""
    deadline = clock() + PEER_WAIT_S
    while pending and all(map(peer_consequence, failures)) and clock() < deadline:
        stop.check()
        try:
            tick()
        except RankFailedError as e:
            raise RankFailedError([*e.failures, *failures], gang.world_size) from None
        done, pending[:] = gang.wait(pending, 1, POLL_S)
        collect(done)
