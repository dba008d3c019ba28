"""Supervision against a fake gang and a fake clock: no Ray, no processes.

The fake gang answers `wait` from a script of (seconds, rank, outcome) and moves the clock as the
real wait would, so root-cause choice, hang timing, signals and restarts are tested in milliseconds.
"""

from __future__ import annotations

import signal

import pytest

from launcher.core.elastic import GrowTo
from launcher.core.errors import Interrupted, RankFailedError, RankFailure
from launcher.core.poll import AllReturned, RanksFailed, StillRunning
from launcher.driver.lifecycle.stop import EarlyInterrupt, StopSignal
from launcher.driver.supervision.supervise import (
    PEER_WAIT_S,
    POLL_S,
    ROOT_CAUSE_WINDOW_S,
    STARTUP_GRACE_S,
    Supervision,
    supervise,
)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def failure(rank: int, kind: str, at: float, summary: str = "") -> RankFailure:
    return RankFailure(rank, "10.0.0.1", "h", str(rank), kind, summary or f"rank {rank} {kind}", at=at)


class FakeGang:
    """Refs are rank numbers; `script[rank] = (seconds, ok, value)` says when and how each ends."""

    def __init__(self, clock: Clock, script: dict[int, tuple[float, bool, object]], world_size: int = 3):
        self.clock, self.script, self.world_size = clock, script, world_size
        self.waits: list[tuple[int, float]] = []
        self.hang_inspected_at: float | None = None
        self.hang_summary = "no output; process stopped (SIGSTOP)"

    def refs(self) -> list[int]:
        return list(range(self.world_size))

    def _ready(self, refs: list[int]) -> list[int]:
        return [r for r in refs if r in self.script and self.script[r][0] <= self.clock.now]

    def wait(self, refs: list, num_returns: int, timeout_s: float) -> tuple[list, list]:
        self.waits.append((num_returns, timeout_s))
        ends = sorted(
            self.script[r][0] for r in refs if r in self.script and self.script[r][0] > self.clock.now
        )
        if len(self._ready(refs)) < num_returns:  # the real wait blocks until enough are ready or timeout
            wanted = num_returns - len(self._ready(refs))
            until = ends[wanted - 1] if len(ends) >= wanted else float("inf")
            self.clock.now = min(self.clock.now + timeout_s, until)
        done = self._ready(refs)[:num_returns]
        return done, [r for r in refs if r not in done]

    def outcome(self, ref: int, rank: int) -> tuple[bool, object]:
        _, ok, value = self.script[ref]
        return ok, value

    def inspect_hang(self, idle_s: float) -> list[RankFailure]:
        self.hang_inspected_at = self.clock.now
        return [failure(0, "hung", self.clock.now, self.hang_summary)]


class FakeRelay:
    def __init__(self, clock: Clock, writes_at: list[float] = ()):
        self.clock, self.writes_at = clock, sorted(writes_at)
        self.writes_seen, self.last_activity = 0, 0.0
        self.pumps: list[float] = []

    def pump(self, wait_s: float = 0.0) -> None:
        self.pumps.append(wait_s)
        seen = [t for t in self.writes_at if t <= self.clock.now]
        if len(seen) != self.writes_seen:
            self.writes_seen, self.last_activity = len(seen), seen[-1]

    def news(self) -> None:
        return None


class NewsRelay(FakeRelay):
    """A relay whose sink answers its long-poll drain at each of `arrivals` (the gang's fake wait
    sees the drain as one more ref, ready then)."""

    def __init__(self, clock: Clock, gang: FakeGang, arrivals: list[float]):
        super().__init__(clock)
        self.gang, self.arrivals, self.asked = gang, list(arrivals), 0
        self.shown_at: list[float] = []
        self._ask()

    def _ask(self) -> None:
        self.asked += 1
        at = self.arrivals.pop(0) if self.arrivals else float("inf")
        self.gang.script[f"drain{self.asked}"] = (at, True, None)

    def news(self) -> str:
        return f"drain{self.asked}"

    def pump(self, wait_s: float = 0.0) -> None:
        super().pump(wait_s)
        at = self.gang.script[self.news()][0]
        if at <= self.clock.now:
            self.shown_at.append(self.clock.now)
            self._ask()


def test_every_rank_returning_gives_the_values_by_rank():
    clock = Clock()
    gang = FakeGang(clock, {0: (1.0, True, "a"), 1: (3.0, True, "b"), 2: (2.0, True, "c")})
    ticks = []
    checks = lambda: ticks.append(1)  # noqa: E731
    assert supervise(gang, gang.refs(), StopSignal(), checks=checks, clock=clock) == ("a", "b", "c")
    assert ticks  # the spares are tended on every turn


def test_each_look_says_what_it_found_typed_and_a_grow_found_by_the_checks_ends_it():
    """The controller decides from what one look finds (core/poll.py): nothing yet, every rank back,
    or what the checks found (a grow here), never an exception out of a callback."""
    clock = Clock()
    gang = FakeGang(clock, {0: (1.0, True, "a"), 1: (1.0, True, "b"), 2: (1.0, True, "c")})
    watch = Supervision(gang, gang.refs(), clock=clock)
    assert watch.poll() == StillRunning() and clock.now < 1.0
    while (found := watch.poll()) == StillRunning():
        pass
    assert found == AllReturned(("a", "b", "c")) and watch.poll() == found

    clock = Clock()
    gang = FakeGang(clock, {0: (9.0, True, "a")})
    grow = GrowTo(3, "room for 3")
    watch = Supervision(gang, gang.refs(), checks=lambda: grow if clock.now >= 2.0 else None, clock=clock)
    looks = []
    while (found := watch.poll()) == StillRunning():
        looks.append(clock.now)
    assert found is grow and 2.0 <= clock.now < 2.5 and len(looks) >= 8


def test_calls_that_end_together_are_collected_in_one_pass_not_one_wait_each():
    """At the end of a run every rank returns at once: one wait per rank over all those still pending
    would be quadratic (33.6M ref scans at 8,192 ranks)."""
    clock = Clock()
    world = 1000
    gang = FakeGang(clock, {r: (5.0, True, r) for r in range(world)}, world_size=world)
    assert supervise(gang, gang.refs(), StopSignal(), clock=clock) == tuple(range(world))
    assert len(gang.waits) <= 25  # 20 turns of POLL_S until 5 s, then one to collect them all


def test_what_the_sink_has_to_show_is_shown_when_it_arrives_not_at_the_next_turn():
    """The relay's drain is waited for beside the ranks: lines that reach the sink mid-turn are
    shown then (each answer asks the next drain), and the turn still lasts POLL_S, so the checks
    (signals, liveness) run as often as before. A rank's end still ends the wait at once."""
    clock = Clock()
    gang = FakeGang(clock, {0: (0.4, True, "a"), 1: (9.0, True, "b"), 2: (9.0, True, "c")})
    relay = NewsRelay(clock, gang, arrivals=[0.07, 0.19, 0.3])
    watch = Supervision(gang, gang.refs(), relay=relay, clock=clock)
    assert watch.poll() == StillRunning()
    assert relay.shown_at == [0.07, 0.19] and clock.now == POLL_S
    assert watch.poll() == StillRunning()  # rank 0 returned: the turn ends then
    assert relay.shown_at == [0.07, 0.19, 0.3] and clock.now == 0.4
    assert 0 not in watch.pending and len(watch.pending) == 2


def test_a_dead_rank_is_the_root_cause_over_peers_that_failed_just_after_it():
    clock = Clock()
    died = failure(2, "died", at=5.00)
    peer = failure(
        0, "exception", at=4.99, summary="RuntimeError: Connection reset by peer"
    )  # reported first
    late = failure(1, "exception", at=9.0)
    gang = FakeGang(clock, {0: (5.0, False, peer), 2: (5.05, False, died), 1: (9.0, False, late)})
    relay = FakeRelay(clock)
    with pytest.raises(RankFailedError) as e:
        supervise(gang, gang.refs(), StopSignal(), relay=relay, clock=clock)
    assert e.value.root.rank == 2 and "died" in e.value.root.kind
    assert [f.rank for f in e.value.failures] == [2, 0]  # rank 1 failed after the window: not waited for
    assert (2, ROOT_CAUSE_WINDOW_S) in gang.waits
    assert relay.pumps[-1] == 2.0  # the failing rank's last lines are fetched before the report


def test_a_peer_s_connection_error_waits_for_the_death_that_caused_it():
    """#46: a node's processes killed, a survivor's gloo error reached the driver first and was named
    the root cause; the dead rank, told seconds later, is the cause."""
    clock = Clock()
    peer = failure(0, "exception", at=1.0, summary="RuntimeError: [gloo] Connection reset by peer")
    died = failure(2, "died", at=3.5)
    gang = FakeGang(clock, {0: (1.0, False, peer), 2: (3.5, False, died)})
    with pytest.raises(RankFailedError) as e:
        supervise(gang, gang.refs(), StopSignal(), clock=clock)
    assert e.value.root.rank == 2 and [f.rank for f in e.value.failures] == [2, 0]
    assert clock.now == 3.5  # it ended once the cause was told, not at the wait's bound


def test_a_lost_node_told_by_the_node_checks_is_the_cause_of_a_peer_s_connection_error():
    clock = Clock()
    peer = failure(0, "exception", at=1.0, summary="RuntimeError: [gloo] Connection reset by peer")
    lost = failure(1, "died", at=4.0, summary="its node 10.0.0.2 was lost")
    gang = FakeGang(clock, {0: (1.0, False, peer)})

    def checks() -> RanksFailed | None:
        return RanksFailed(RankFailedError([lost], gang.world_size)) if clock.now >= 4.0 else None

    with pytest.raises(RankFailedError) as e:
        supervise(gang, gang.refs(), StopSignal(), checks=checks, clock=clock)
    assert e.value.root.summary == "its node 10.0.0.2 was lost" and [f.rank for f in e.value.failures] == [
        1,
        0,
    ]


def test_a_connection_error_alone_is_named_after_the_bounded_wait_and_other_errors_wait_not():
    clock = Clock()
    peer = failure(0, "exception", at=1.0, summary="RuntimeError: Connection reset by peer")
    gang = FakeGang(clock, {0: (1.0, False, peer)})
    with pytest.raises(RankFailedError) as e:
        supervise(gang, gang.refs(), StopSignal(), clock=clock)
    assert e.value.root.rank == 0 and 1.0 + PEER_WAIT_S <= clock.now <= 1.0 + PEER_WAIT_S + 0.5
    clock = Clock()
    own = failure(0, "exception", at=1.0, summary="ValueError: bad batch")
    gang = FakeGang(clock, {0: (1.0, False, own)})
    with pytest.raises(RankFailedError):
        supervise(gang, gang.refs(), StopSignal(), clock=clock)
    assert clock.now <= 1.0 + ROOT_CAUSE_WINDOW_S  # a program's own error ends the attempt at once


def test_silence_is_a_hang_only_after_the_startup_grace_then_after_the_timeout():
    clock = Clock()
    gang = FakeGang(clock, {})  # nobody ever ends
    with pytest.raises(RankFailedError) as e:
        supervise(gang, gang.refs(), StopSignal(), relay=FakeRelay(clock), hang_timeout_s=5, clock=clock)
    assert STARTUP_GRACE_S < gang.hang_inspected_at <= STARTUP_GRACE_S + 0.5  # before any output: the grace
    assert e.value.root.kind == "hung"

    clock = Clock()
    gang = FakeGang(clock, {})
    relay = FakeRelay(clock, writes_at=[1.0, 4.0, 8.0])  # never 5 s apart until the last
    with pytest.raises(RankFailedError):
        supervise(gang, gang.refs(), StopSignal(), relay=relay, hang_timeout_s=5, clock=clock)
    assert 13.0 < gang.hang_inspected_at <= 13.5  # 5 s after the last line


def test_no_relay_or_a_zero_timeout_never_reports_a_hang():
    for relay_on, timeout in ((False, 5.0), (True, 0.0)):
        clock = Clock()
        gang = FakeGang(clock, {0: (500.0, True, 0), 1: (500.0, True, 1), 2: (500.0, True, 2)})
        relay = FakeRelay(clock) if relay_on else None
        assert supervise(gang, gang.refs(), StopSignal(), relay=relay, hang_timeout_s=timeout, clock=clock)
        assert gang.hang_inspected_at is None


def test_a_hang_read_by_faulthandler_waits_for_the_stacks_to_reach_the_logs():
    clock = Clock()
    gang = FakeGang(clock, {})
    gang.hang_summary = "no output; stack read by faulthandler (see the rank's log)"
    relay = FakeRelay(clock, writes_at=[1.0])
    with pytest.raises(RankFailedError):
        supervise(gang, gang.refs(), StopSignal(), relay=relay, hang_timeout_s=5, clock=clock)
    assert relay.pumps[-1] == 2.0


def test_a_stop_signal_interrupts_with_the_shell_exit_code():
    clock = Clock()
    gang = FakeGang(clock, {})
    stop = StopSignal()
    stop.receive(signal.SIGTERM)
    with pytest.raises(Interrupted) as e:
        supervise(gang, gang.refs(), stop, clock=clock)
    assert e.value.exit_code == 143


def test_a_signal_is_acted_on_once_so_the_teardown_waits_out_the_kill_grace():
    """The waits after the first signal (the ranks' --kill-grace) go on; a second one ends them."""
    stop = StopSignal()
    stop.receive(signal.SIGINT)
    with pytest.raises(Interrupted):
        stop.check()
    stop.check()  # the teardown's waits: not interrupted again by the same signal
    with pytest.raises(Interrupted) as e:
        stop.receive(signal.SIGINT)  # a second Ctrl-C while stopping
    assert e.value.exit_code == 130
    stop.check()


def test_a_ctrl_c_an_import_swallowed_is_raised_again_at_the_next_step_without_its_traceback():
    """CI saw it: Ctrl-C landed in a weakref callback of the preflight's imports, Python printed
    "Exception ignored" and the launch went on. Here a `__del__` takes the signal the same way."""
    import subprocess
    import sys

    code = """
import os, signal, sys
from launcher.driver.lifecycle.stop import EarlyInterrupt

class Dies:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10000):
            pass  # Python's handler runs here, inside __del__: the KeyboardInterrupt is printed and dropped

with EarlyInterrupt().installed() as early:
    try:
        Dies()
        print("went on")
        early.check()
    except KeyboardInterrupt:
        print("interrupted")
        sys.exit(130)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout.split()) == (130, ["went", "on", "interrupted"]), p.stderr
    assert p.stderr == ""


def test_an_error_left_by_a_ctrl_c_an_import_swallowed_is_the_ctrl_c():
    """A fresh-clone run: Ctrl-C 3 s into `--check`'s bridge import was lost inside it, cut numpy's
    set-up short, and the next import failed with an AttributeError: a traceback and exit 1 where
    one line and 130 were due. Here a `__del__` takes the signal and an error follows."""
    import subprocess
    import sys

    code = """
import os, signal, sys
from launcher.driver.lifecycle.stop import EarlyInterrupt

class Dies:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10000):
            pass

try:
    with EarlyInterrupt().installed():
        Dies()
        raise AttributeError("module 'numpy._core' has no attribute '_multiarray_umath'")
except KeyboardInterrupt as e:
    print("interrupted", e.__cause__, e.__suppress_context__)
    sys.exit(130)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout.split()) == (130, ["interrupted", "None", "True"]), p.stderr
    assert p.stderr == ""
    with pytest.raises(AttributeError), EarlyInterrupt().installed():  # no Ctrl-C: an error is itself
        raise AttributeError("x")


def test_a_ctrl_c_while_a_ray_starts_here_is_acted_on_once_the_start_returns():
    """CI: Ctrl-C 3 s into a local launch, while its Ray started, and the driver said nothing more for
    60 s. Held there, the first Ctrl-C is raised once the start is done (its Ray then stopped as after
    any Ctrl-C); a second is raised at once; outside, one is raised where it lands."""
    import os

    early = EarlyInterrupt()
    with early.installed():
        with pytest.raises(KeyboardInterrupt), early.held():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass  # the handler runs here, and raises nothing
            started = True
        assert started
    again = EarlyInterrupt()
    with again.installed(), pytest.raises(KeyboardInterrupt), again.held():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second: at once
            for _ in range(1000):
                pass
    with EarlyInterrupt().installed(), early.held():
        pass  # not the handler installed: nothing held, nothing raised
