"""The controller's transitions (driver/lifecycle/controller.py) against a fake attempt: no Ray, no processes.

Each test scripts what the attempt's state methods do (return, raise a rank failure, raise on a
signal) and reads where the launch went: its state, the states it went through, what was torn down,
what the failure policy decided. As Ray Train tests its controller with a dummy worker group.
"""

from __future__ import annotations

import dataclasses
import signal

import pytest

from launcher.core.elastic import Evict, GrowTo
from launcher.core.errors import FailureKind, Interrupted, RankFailedError, RankFailure, ResourceError
from launcher.core.lifecycle import LaunchState
from launcher.core.outcome import run_outcome
from launcher.core.policy import FailureDecision, FailurePolicy
from launcher.core.poll import AllReturned, RanksFailed, StillRunning
from launcher.driver.lifecycle.controller import RELAUNCHED, REMOVED, Controller, LaunchObserver, RestartKind

P, S, R, F = LaunchState.PLACING, LaunchState.STARTING, LaunchState.RUNNING, LaunchState.FINISHING
RESTARTING = LaunchState.RESTARTING


def failure(rank: int, kind: FailureKind, at: float, summary: str = "") -> RankFailure:
    return RankFailure(rank, "10.0.0.1", "h", str(rank), kind, summary or f"rank {rank} {kind}", at=at)


def failed(kind: FailureKind = FailureKind.DIED, at: float = 1.0, summary: str = "") -> RankFailedError:
    return RankFailedError([failure(1, kind, at, summary)], 2)


class FakeAttempt:
    """`script[state method] = exception` makes that method raise, or is what `poll` finds (a rank
    failure, a grow); the rest succeed."""

    def __init__(self, placing, events: list, script: dict | None = None):
        self.number, self.spares_in, self.events, self.script = (
            placing.number,
            placing.spares,
            events,
            script or {},
        )
        self.growing, self.avoid, self.evicted = placing.growing, placing.avoid, placing.evicted
        self.adopted = False
        self.torn_down = False

    def _step(self, name: str):
        self.events.append((name, self.number))
        if name in self.script:
            raise self.script[name]

    def place(self):
        self._step("place")
        self.adopted = self.spares_in is not None

    def start(self):
        self._step("start")

    def poll(self):
        """A scripted rank failure or grow is what the look finds (core/poll.py); anything else raises."""
        found = self.script.get("poll")
        if isinstance(found, RankFailedError | GrowTo | Evict):
            self.events.append(("poll", self.number))
            return RanksFailed(found) if isinstance(found, RankFailedError) else found
        self._step("poll")
        return AllReturned(())

    def finish(self):
        self._step("finish")
        return f"result of attempt {self.number}"

    def hand_over(self):
        self.events.append(("hand_over", self.number))
        return f"spares of attempt {self.number}"

    @property
    def lost_nodes(self) -> frozenset[str]:
        """What it was given to avoid, unless scripted (nodes found lost, or one that answered again)."""
        return self.script.get("lost_nodes", self.avoid)

    def teardown(self):
        assert not self.torn_down, "torn down twice"
        self.torn_down = True
        self.events.append(("teardown", self.number))


def controller(
    max_restarts: int, scripts: dict[int, dict], events: list, states: list | None = None,
    made: list | None = None,
):  # fmt: skip
    """`made` collects the attempts made, in order."""
    clock = iter(range(1000))

    def new_attempt(p):
        attempt = FakeAttempt(p, events, scripts.get(p.number))
        (made if made is not None else []).append(attempt)
        return attempt

    return Controller(
        FailurePolicy(max_restarts),
        new_attempt,
        observers=(Recorder(states if states is not None else []),),
        clock=lambda: float(next(clock)),
    )


class Recorder(LaunchObserver):
    """Every state it is told, in `states`; failures and restarts in their own lists."""

    def __init__(self, states: list):
        self.states, self.failures, self.restarts = states, [], []

    def on_state(self, state):
        self.states.append(state)

    def on_failure(self, failure):
        self.failures.append(failure)

    def on_restart(self, restart):
        self.restarts.append(restart)


def test_an_attempt_steps_placing_starting_running_finishing_succeeded():
    events: list = []
    c = controller(0, {}, events)
    assert c.run() == "result of attempt 0"
    assert [s for s, _ in c.history] == [P, S, R, F, LaunchState.SUCCEEDED]
    assert [at for _, at in c.history] == sorted(at for _, at in c.history)
    assert events == [("place", 0), ("start", 0), ("poll", 0), ("finish", 0), ("teardown", 0)]
    assert c.attempt is None and c.state is LaunchState.SUCCEEDED


def test_running_is_looked_at_until_the_look_finds_an_end_and_is_one_state_in_the_history():
    events: list = []

    class RunsThreeLooks(FakeAttempt):
        looks = 0

        def poll(self):
            self.looks += 1
            return AllReturned(()) if self.looks == 3 else StillRunning()

    c = Controller(FailurePolicy(0), lambda p: RunsThreeLooks(p, events))
    assert c.run() == "result of attempt 0" and c.last_attempt.looks == 3
    assert [s for s, _ in c.history] == [P, S, R, F, LaunchState.SUCCEEDED]


def test_a_start_failure_is_an_error_and_the_attempt_is_torn_down():
    events: list = []
    c = controller(3, {0: {"start": ResourceError("no GPUs")}}, events)
    with pytest.raises(ResourceError):
        c.run()
    assert [s for s, _ in c.history] == [P, S, LaunchState.ERROR]  # not a rank failure: no restart
    assert events[-1] == ("teardown", 0) and c.restarts == []


def test_a_placement_that_cannot_fit_is_an_error():
    events: list = []
    c = controller(1, {0: {"place": ResourceError("the layout does not fit")}}, events)
    with pytest.raises(ResourceError):
        c.run()
    assert c.state is LaunchState.ERROR and events == [("place", 0), ("teardown", 0)]


@pytest.mark.parametrize(
    "kind, summary",
    [
        (FailureKind.DIED, "killed by SIGKILL"),
        (FailureKind.HUNG, "no output for 60s; process stopped (SIGSTOP)"),
        (FailureKind.DIED, "its node 10.0.0.2 (node id abcd1234) was lost"),
        (FailureKind.EXCEPTION, "ValueError: bad"),
    ],
)
def test_a_rank_failure_with_no_restart_left_fails_the_launch(kind, summary):
    """A dead rank, a hang, a lost node, an exception: each ends the same way with no restarts."""
    events: list = []
    error = failed(kind, summary=summary)
    c = controller(0, {0: {"poll": error}}, events)
    with pytest.raises(RankFailedError) as e:
        c.run()
    assert e.value is error and e.value.ending == REMOVED
    assert [s for s, _ in c.history] == [P, S, R, LaunchState.FAILED]
    assert events[-1] == ("teardown", 0) and ("hand_over", 0) not in events


def test_a_restart_hands_the_spares_over_before_teardown_and_is_recorded(capsys):
    events: list = []
    c = controller(2, {0: {"poll": failed(at=1.0)}, 1: {"poll": failed(at=2.0)}}, events)
    assert c.run() == "result of attempt 2"
    assert events == [
        ("place", 0), ("start", 0), ("poll", 0), ("hand_over", 0), ("teardown", 0),
        ("place", 1), ("start", 1), ("poll", 1), ("hand_over", 1), ("teardown", 1),
        ("place", 2), ("start", 2), ("poll", 2), ("finish", 2), ("teardown", 2),
    ]  # fmt: skip
    assert [s for s, _ in c.history] == [
        P,
        S,
        R,
        RESTARTING,
        P,
        S,
        R,
        RESTARTING,
        P,
        S,
        R,
        F,
        LaunchState.SUCCEEDED,
    ]
    assert [(r.attempt, r.warm_spares) for r in c.restarts] == [(1, True), (2, True)]
    assert all("rank 1 on 10.0.0.1 (h) failed" in r.cause for r in c.restarts)
    assert set(c.restarts[0].record()) == {"attempt", "cause", "at", "warm_spares", "kind"}  # summary.json's
    err = capsys.readouterr().err
    assert err.count("Root cause (first failure):") == 2 and RELAUNCHED in err  # each failure's report


def test_the_last_failure_is_raised_once_restarts_run_out():
    events: list = []
    c = controller(1, {0: {"poll": failed(at=0.0)}, 1: {"poll": failed(at=1.0)}}, events)
    with pytest.raises(RankFailedError) as e:
        c.run()
    (recorder,) = c.observers  # told of both failures, the one relaunch, and the end
    assert [f.root.at for f in recorder.failures] == [0.0, 1.0]
    assert [(r.attempt, r.kind) for r in recorder.restarts] == [(1, RestartKind.FAILURE)]
    assert recorder.states[-1] is LaunchState.FAILED
    assert e.value.root.at == 1.0 and e.value.ending == REMOVED  # attempt 1's failure
    assert [ev for ev in events if ev[0] == "teardown"] == [("teardown", 0), ("teardown", 1)]
    assert ("hand_over", 1) not in events and len(c.restarts) == 1
    assert c.restarts[0].warm_spares is True


def test_a_crash_on_the_way_out_is_a_failure_the_policy_restarts():
    """A process dying after its program returned counts as torchrun counts its exit status."""
    events: list = []
    c = controller(1, {0: {"finish": failed(summary="after the program returned, on its way out")}}, events)
    assert c.run() == "result of attempt 1"
    assert [s for s, _ in c.history][:5] == [P, S, R, F, RESTARTING]


def test_a_failed_relaunch_placement_records_that_no_spares_were_taken():
    events: list = []
    scripts = {0: {"poll": failed()}, 1: {"place": ResourceError("gone")}}

    def no_spares(p):
        return FakeAttempt(
            dataclasses.replace(p, spares=None), events, scripts.get(p.number)
        )  # the spares could not take over

    c = Controller(FailurePolicy(1), no_spares)
    with pytest.raises(ResourceError):
        c.run()
    assert c.restarts[0].warm_spares is False and c.state is LaunchState.ERROR


@pytest.mark.parametrize("state_method", ["place", "start", "poll", "finish"])
def test_ctrl_c_in_any_state_is_interrupted_and_tears_down(state_method):
    events: list = []
    c = controller(2, {0: {state_method: Interrupted(signal.SIGINT, "SIGINT")}}, events)
    with pytest.raises(Interrupted) as e:
        c.run()
    assert e.value.exit_code == 130 and c.state is LaunchState.INTERRUPTED
    assert events[-1] == ("teardown", 0) and c.restarts == []


def test_sigterm_during_a_restarts_teardown_ends_the_launch_interrupted():
    events: list = []

    class StoppedInTeardown(FakeAttempt):
        def teardown(self):
            super().teardown()
            raise Interrupted(signal.SIGTERM, "SIGTERM")

    script = {"poll": failed()}
    c = Controller(FailurePolicy(3), lambda p: StoppedInTeardown(p, events, script))
    with pytest.raises(Interrupted):
        c.run()
    assert c.state is LaunchState.INTERRUPTED and events.count(("teardown", 0)) == 1
    assert run_outcome(Interrupted(signal.SIGTERM, "SIGTERM")).exit_code == 143


def test_states_are_reported_as_they_happen():
    states: list = []
    c = controller(1, {0: {"poll": failed()}}, [], states)
    c.run()
    assert states == [s for s, _ in c.history[1:]]  # placing is where every launch begins


# -- the pure rules the controller applies -------------------------------------------------------
def test_the_policy_restarts_while_restarts_are_left():
    policy = FailurePolicy(2)
    assert [policy.decide(failed(), done) for done in range(4)] == [
        FailureDecision.RESTART, FailureDecision.RESTART, FailureDecision.FAIL, FailureDecision.FAIL,
    ]  # fmt: skip
    assert FailurePolicy(0).decide(failed(FailureKind.HUNG), 0) is FailureDecision.FAIL
    with pytest.raises(ValueError, match="got -1"):
        FailurePolicy(-1)


def test_how_a_launch_ended_and_its_exit_code():
    assert (run_outcome(None).status, run_outcome(None).exit_code) == (LaunchState.SUCCEEDED, 0)
    rank = run_outcome(failed())
    assert (rank.status, rank.exit_code, len(rank.failures)) == (LaunchState.FAILED, 1, 1)
    assert run_outcome(ResourceError("x")).exit_code == 2
    assert run_outcome(KeyboardInterrupt()).exit_code == 130
    crash = run_outcome(ZeroDivisionError("x"))
    assert (crash.status, crash.exit_code, crash.root_cause) == (LaunchState.ERROR, 1, "ZeroDivisionError: x")
    assert run_outcome(None).summary() == {"status": "succeeded", "exit_code": 0, "root_cause": None}
    with pytest.raises(ValueError):
        type(crash)(LaunchState.RUNNING, 0)  # a launch still running has not ended


def test_the_root_cause_is_a_death_over_a_hang_over_an_exception_then_the_earliest():
    raised = failure(0, FailureKind.EXCEPTION, at=1.0)
    hung = failure(1, FailureKind.HUNG, at=3.0)
    died_late, died_early = failure(2, FailureKind.DIED, at=5.0), failure(3, FailureKind.DIED, at=4.0)
    error = RankFailedError([raised, hung, died_late, died_early], 4)
    assert [f.rank for f in error.failures] == [3, 2, 1, 0]


def test_a_node_lost_at_8192_ranks_is_reported_in_one_screen():
    """8 ranks of the lost node died; 8,184 peers failed in the same collective: one line each kind."""
    world, lost = 8192, range(4088, 4096)
    failures = [
        RankFailure(r, "10.0.2.255", "n511", "0", FailureKind.DIED, "its node 10.0.2.255 was lost", at=5.0)
        for r in lost
    ] + [
        RankFailure(r, f"10.0.{r // 2048}.{r // 8 % 256}", "h", str(r % 8), FailureKind.EXCEPTION,
                    "RuntimeError: NCCL communicator was aborted", at=6.0)
        for r in range(world) if r not in lost
    ]  # fmt: skip
    report = RankFailedError(failures, world).report()
    assert len(report.splitlines()) < 40
    assert "rank      : 4088 of 8192" in report
    assert "  ranks 4089-4095 (7) on 10.0.2.255: its node 10.0.2.255 was lost" in report
    assert "  ranks 0-4087,4096-8191 (8184) on 1023 nodes: RuntimeError: NCCL communicator" in report


def test_many_kinds_of_failure_are_cut_to_a_screen_and_one_rank_reads_as_before():
    failures = [
        RankFailure(r, "10.0.0.1", "h", "0", FailureKind.EXCEPTION, f"error {r}", at=r) for r in range(50)
    ]
    report = RankFailedError(failures, 50).report()
    assert "  rank 1 on 10.0.0.1: error 1" in report and "error 21" not in report
    assert "... and 29 more kinds of failure" in report


def test_ranks_waiting_in_the_same_frames_show_one_stack():
    from launcher.core.hang import group_stacks

    def dump(pid: int, frame: str) -> dict:
        text = f'Process {pid}: python train.py\nPython v3.12.3\n\nThread {pid} (idle): "MainThread"\n'
        text += f"    {frame}\n"
        return {"pid": pid, "stack": text}

    seen = {r: dump(100 + r, "barrier (torch/distributed/c10d.py:4000)") for r in range(8)}
    seen[3] = dump(103, "forward (model.py:12)")
    seen[5] = {"pid": 105, "stack": None}
    groups = group_stacks(seen)
    assert [(ranks, info["pid"]) for ranks, info in groups] == [([0, 1, 2, 4, 6, 7], 100), ([3], 103)]


# -- megaray's own liveness of the job's nodes -------------------------------------------------------
def test_a_node_is_lost_after_three_missed_probes_and_four_silent_seconds():
    from launcher.core.liveness import Liveness

    live = Liveness(["a", "b"], started=0.0)
    live.answered("b", 0.5)
    for t in (1.0, 2.0, 3.0):
        live.answered("a", t)
        live.missed("b", "no answer within 1s")
    assert live.lost(3.0) == {}  # three misses, but only 3 s since the start
    live.missed("b", "no answer within 1s")
    assert live.lost(4.5) == {"b": (4.0, "no answer within 1s")}  # silent since it answered at 0.5
    live.answered("b", 5.0)  # a node that answers again is no longer lost
    assert live.lost(5.0) == {}
    live.missed("a", "Connection refused")  # one refusal is not enough
    assert live.lost(9.0) == {}


def test_a_node_that_never_answered_is_left_to_ray_and_said_so():
    """A firewall between the driver and a raylet's port must not end every run after 4 s."""
    from launcher.core.liveness import Liveness

    live = Liveness(["walled"], started=0.0)
    for _ in range(5):
        live.missed("walled", "no answer within 1s")
    assert live.lost(60.0) == {} and live.unprobed() == {"walled": "no answer within 1s"}


def test_probes_tell_an_answering_node_from_a_closed_port_and_a_silent_one():
    import socket
    import time

    from launcher.driver.supervision.liveness import NodeProbes

    listening = socket.create_server(("127.0.0.1", 0))
    refusing = socket.create_server(("127.0.0.1", 0))
    # silent as a cut link is: its accept queue full, the kernel drops new connections unanswered
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    held: list[socket.socket] = []
    now = [0.0]
    probes = NodeProbes(
        {"up": listening.getsockname(), "refusing": refusing.getsockname(), "silent": full.getsockname()},
        clock=lambda: now[0],
    )
    try:
        for tick in range(70):  # 7 s of ticks, a tenth of a second apart
            if tick == 10:  # every node answered once (their first probes are spread over a second)
                assert probes.liveness.lost(now[0]) == {} and not probes.liveness.unprobed()
                assert all(n.answered for n in probes.liveness._seen.values())
                refusing.close()  # then "silent" goes silent, "refusing" closes
                for _ in range(4):
                    held.append(socket.socket())
                    held[-1].setblocking(False)
                    held[-1].connect_ex(full.getsockname())
            lost = probes.tick()
            time.sleep(0.1)
            now[0] += 0.1
        assert set(lost) == {"refusing", "silent"}
        assert "refused" in lost["refusing"][1] and lost["silent"][1] == "no answer within 1s"
        assert lost["silent"][0] >= 4.0
    finally:
        probes.close()
        for s in [listening, full, *held]:
            s.close()


def test_probes_are_spread_over_a_second_and_kept_within_the_descriptor_limit():
    """A thousand nodes are not probed in one turn: their first probes spread over a period, and no
    more sockets are open at once than the driver's descriptor limit allows."""
    import socket

    from launcher.driver.supervision.liveness import NodeProbes

    server = socket.create_server(("127.0.0.1", 0), backlog=128)
    now = [0.0]
    probes = NodeProbes({f"n{i}": server.getsockname() for i in range(1000)}, clock=lambda: now[0])
    try:
        starts = sorted(probes.next_at.values())
        assert starts[0] == 0.0 and 0.99 <= starts[-1] < 1.0 and len(set(starts)) == 1000
        many = NodeProbes({f"n{i}": ("127.0.0.1", 9) for i in range(4096)})
        assert many.every == 2.048  # the driver sends 2,000 a second at most
        many.close()
        probes.max_inflight = 50
        now[0] = 1.0  # every probe due: only 50 go out, the rest on later turns
        probes.tick()
        tried = [n for n, seen in probes.liveness._seen.items() if seen.answered] + list(probes.inflight)
        assert len(tried) == 50
    finally:
        probes.close()
        server.close()


def test_growing_relaunches_without_counting_against_max_restarts():
    """--nodes MIN:MAX below MAX with room for more: the attempt ends with GrowTo, every rank is
    relaunched (the attempt torn down, no spares handed over), and a later failure still has its
    restart: grows are not failures."""
    events: list = []
    grow = GrowTo(3, "the cluster has room for 3 node(s)")
    attempts: list = []
    c = controller(1, {0: {"poll": grow}, 1: {"poll": failed()}}, events, made=attempts)
    assert c.run() == "result of attempt 2"
    again = [RESTARTING, P, S, R]
    assert [s for s, _ in c.history] == [P, S, R, *again, *again, F, LaunchState.SUCCEEDED]
    assert ("hand_over", 0) not in events and ("teardown", 0) in events and ("hand_over", 1) in events
    assert [(r.attempt, r.kind) for r in c.restarts] == [(1, RestartKind.GROW), (2, RestartKind.FAILURE)]
    assert c.restarts[0].cause == "the cluster has room for 3 node(s)" and c.failed == 1
    # only the grow's relaunch waits for the nodes it saw room for (driver/gang/sources.py GROW_SETTLE_S)
    assert [a.growing for a in attempts] == [False, True, False]


def test_the_nodes_found_lost_travel_with_the_states_to_each_next_placing():
    """A failed attempt's lost nodes are kept off by the relaunch (`Placing.avoid`), a grow's relaunch
    keeps off what its attempt still counts lost (one that answered again is taken off by it), and a
    placing that fails to start a new attempt still knows what the last one found."""
    events: list = []
    attempts: list = []
    grow = GrowTo(3, "the cluster has room for 3 node(s)")
    scripts = {
        0: {"poll": failed(), "lost_nodes": frozenset({"n1", "n2"})},
        1: {"poll": grow, "lost_nodes": frozenset({"n2"})},  # n1 answered again while it ran
    }
    c = controller(1, scripts, events, made=attempts)
    assert c.run() == "result of attempt 2"
    assert [a.avoid for a in attempts] == [frozenset(), frozenset({"n1", "n2"}), frozenset({"n2"})]


def test_a_slow_node_dropped_is_a_relaunch_not_counted_and_kept_off_by_every_later_attempt():
    """--evict-stragglers: the attempt ends with Evict; the relaunch and every one after it keep that
    node off (`Placing.evicted`), beside the lost nodes, which one answering again takes off; the
    failure after it still has its restart."""
    events: list = []
    attempts: list = []
    evict = Evict("n3", 31.0, "a checkpoint was saved since", "10.0.0.3 (c)")
    scripts = {0: {"poll": evict}, 1: {"poll": failed(), "lost_nodes": frozenset({"n1"})}}
    c = controller(1, scripts, events, made=attempts)
    assert c.run() == "result of attempt 2"
    assert [(r.attempt, r.kind) for r in c.restarts] == [(1, RestartKind.EVICT), (2, RestartKind.FAILURE)]
    assert c.restarts[0].cause == (
        "a rank on node 10.0.0.3 (c) has been slow for 31s and a checkpoint was saved since: "
        "dropping its node"
    )
    assert [a.evicted for a in attempts] == [frozenset(), frozenset({"n3"}), frozenset({"n3"})]
    assert [a.avoid for a in attempts] == [frozenset(), frozenset(), frozenset({"n1"})]
    assert c.failed == 1 and ("hand_over", 0) not in events
