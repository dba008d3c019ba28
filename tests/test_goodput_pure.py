"""The goodput ledger (core/goodput.py, #47): a launch's wall time split by cause, worked out from
when it began and ended and the iterations its ranks reported; the parts add up to the wall time."""

from __future__ import annotations

import pytest

from launcher.core.goodput import NO_CHECKPOINTS, Cause, GoodputTrack, Ledger, advice, ledger
from launcher.core.progress import Phase, parse_checkpoint_line


def _track(*attempts: list[tuple[float, int]]) -> GoodputTrack:
    track = GoodputTrack()
    for n, reported in enumerate(attempts):
        if n:
            track.relaunched()
        for at, iteration in reported:
            track.iteration(at, iteration)
    return track


def test_one_attempt_is_start_up_training_and_the_end():
    spent = ledger(_track([(10.0, 1), (15.0, 6), (20.0, 11)]), began=0.0, ended=25.0)
    assert spent.seconds == {
        Cause.TRAINING: 10.0, Cause.STARTUP: 10.0, Cause.RESTARTS: 0.0, Cause.RECOMPUTED: 0.0,
        Cause.CHECKPOINT: 0.0, Cause.STRAGGLER: 0.0, Cause.IDLE: 5.0,
    }  # fmt: skip
    assert spent.ratio == pytest.approx(0.4) and spent.restarts == 0
    assert spent.describe() == "goodput 40.0% of 25.0s: training 10.0s, start-up 10.0s, idle 5.0s"


def test_a_restart_from_an_older_checkpoint_counts_the_relaunch_and_the_iterations_made_again():
    # 1 s an iteration; failed after 50; resumed from the checkpoint at 30: 31..50 made again, the
    # 31st (reported at 80 s) included
    first = [(10.0, 1), (59.0, 50)]
    second = [(80.0, 31), (149.0, 100)]
    spent = ledger(_track(first, second), began=0.0, ended=150.0)
    assert spent.seconds == {
        Cause.TRAINING: 49.0 + 50.0, Cause.STARTUP: 10.0, Cause.RESTARTS: 20.0, Cause.RECOMPUTED: 20.0,
        Cause.CHECKPOINT: 0.0, Cause.STRAGGLER: 0.0, Cause.IDLE: 1.0,
    }  # fmt: skip
    assert sum(spent.seconds.values()) == pytest.approx(spent.wall_s) == 150.0
    assert spent.restarts == 1
    assert spent.record()["seconds"] == {
        "training": 99.0, "start-up": 10.0, "restarts": 20.0, "recomputed": 20.0, "checkpoint": 0.0,
        "straggler": 0.0, "idle": 1.0,
    }  # fmt: skip
    assert "restarts 20.0s (1)" in spent.describe()


def test_an_attempt_that_failed_before_its_first_iteration_is_part_of_the_restart():
    spent = ledger(_track([(10.0, 1), (20.0, 11)], [], [(60.0, 12), (70.0, 22)]), began=0.0, ended=70.0)
    assert spent.seconds[Cause.RESTARTS] == 40.0 and spent.restarts == 2
    assert spent.seconds[Cause.RECOMPUTED] == 0.0  # it resumed where the first had reached


def test_nothing_reported_is_no_ledger_and_a_clock_ahead_is_taken_off_the_training():
    assert ledger(_track([]), began=0.0, ended=10.0) is None
    # a rank's clock 2 s ahead of the driver's: its last report "after" the end
    spent = ledger(_track([(5.0, 1), (12.0, 8)]), began=0.0, ended=10.0)
    assert spent.wall_s == 10.0 and spent.seconds[Cause.TRAINING] == 5.0 and spent.seconds[Cause.IDLE] == 0.0


def test_a_ledger_whose_parts_do_not_add_up_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"add up to 3\.000 s, not the wall time 4\.000 s"):
        Ledger(4.0, {Cause.TRAINING: 3.0}, restarts=0)


def test_while_the_launch_runs_the_iteration_in_flight_is_training_and_a_pending_relaunch_a_restart():
    running = ledger(_track([(10.0, 1), (20.0, 11)]), began=0.0, ended=25.0, live=True)
    assert (running.seconds[Cause.TRAINING], running.seconds[Cause.IDLE]) == (15.0, 0.0)
    for live in (True, False):  # failed at 20 s, relaunched, nothing reported yet at 30 s
        pending = ledger(_track([(10.0, 1), (20.0, 11)], []), began=0.0, ended=30.0, live=live)
        seen = (pending.seconds[Cause.RESTARTS], pending.seconds[Cause.IDLE], pending.restarts)
        assert seen == (10.0, 0.0, 1)


def test_a_named_straggler_costs_the_share_of_its_slowness_while_it_was_slow_and_the_job_trained():
    track = _track([(10.0, 1), (110.0, 101)])
    track.straggler(3, since=50.0, slowdown=4.0)  # the job went at a quarter of its pace: 3/4 lost
    track.recovered(3, until=70.0)
    track.straggler(5, since=100.0, slowdown=2.0)  # still slow at the end: until the last iteration
    spent = ledger(track, began=0.0, ended=120.0)
    assert spent.seconds[Cause.STRAGGLER] == pytest.approx(20 * 0.75 + 10 * 0.5)
    assert spent.seconds[Cause.TRAINING] == pytest.approx(100 - 20.0)
    assert sum(spent.seconds.values()) == pytest.approx(120.0)
    assert "straggler 20.0s" in spent.describe()
    # a relaunch ends what was named in the attempt before: not counted in the next one's training
    track.relaunched()
    track.iteration(130.0, 102)
    track.iteration(150.0, 122)
    again = ledger(track, began=0.0, ended=150.0)
    assert again.seconds[Cause.STRAGGLER] == pytest.approx(20.0)


def test_checkpoints_saved_and_loaded_are_their_own_cause_wherever_they_fell_and_advise_an_interval():
    """1 s an iteration; saves of 2 s at 30, 60, 90 (training), a failure after 99, a load of 5 s in the
    restart, saves at 150 and 180, and a last one of 5 s after the last iteration (the end's)."""
    track = _track([(10.0, 1), (99.0, 90)], [(120.0, 91), (189.0, 160)])
    for start, end in ((30, 32), (60, 62), (90, 92), (150, 152), (180, 182), (190, 195)):
        attempt = 0 if start < 100 else 1
        _said(track, attempt, (Phase.SAVING, start), (Phase.SAVED, end))
    _said(track, 1, (Phase.LOADING, 110.0), (Phase.LOADED, 115.0))
    track.failures = 1
    spent = ledger(track, began=0.0, ended=200.0)
    assert spent.seconds == {
        Cause.TRAINING: 148.0, Cause.STARTUP: 10.0, Cause.RESTARTS: 16.0, Cause.RECOMPUTED: 0.0,
        Cause.CHECKPOINT: 20.0, Cause.STRAGGLER: 0.0, Cause.IDLE: 6.0,
    }  # fmt: skip
    assert "not_seen" not in spent.record() and NO_CHECKPOINTS in str(
        ledger(_track([(1.0, 1)]), 0, 2).record()
    )
    assert advice(track, 200.0).far is False  # every 25 s, the best 32 s
    far = advice(track, 20000.0)  # a failure every 5.5 hours: far fewer saves lose less
    assert far.far and far.describe() == (
        "checkpoints every 25.0s, each 2.5s to save, with a failure every 5h33m: saving about every 5m16s "
        "(about 316 iterations) would lose least (Young-Daly: the square root of 2 x save cost x time "
        "between failures)"
    )
    track.failures = 0
    assert advice(track, 200.0) is None  # no failure: no time between failures to weigh
    quick = _track([(10.0, 1), (99.0, 90)])
    _said(quick, 0, (Phase.SAVING, 30.0), (Phase.SAVED, 30.2), (Phase.SAVING, 60.0), (Phase.SAVED, 60.2))
    quick.failures = 1
    assert advice(quick, 200.0) is None  # saves of 0.2 s: within what the lines' timing can tell


def _said(track: GoodputTrack, attempt: int, *phases: tuple[Phase, float]) -> None:
    """Checkpoint phases said during `attempt` (the stalls record which)."""
    attempts = track.attempts
    track.attempts = attempts[: attempt + 1]
    for phase, at in phases:
        track.checkpoint(phase, float(at))
    track.attempts = attempts


def test_the_checkpoint_lines_of_megatron_bridge_and_the_dry_run_are_read():
    lines = {
        "saving checkpoint at iteration     100 to /ckpt in torch_dist format": (Phase.SAVING, 100),
        "  successfully saved checkpoint from iteration     100 to /ckpt [ t 1/2, p 1/1 ]": (
            Phase.SAVED,
            100,
        ),
        " loading distributed checkpoint from /ckpt at iteration 100": (Phase.LOADING, 100),
        "  successfully loaded checkpoint from /ckpt [ t 0/2, p 0/1 ] at iteration 100": (Phase.LOADED, 100),
        "saved checkpoint at iteration 30 to /tmp/c": (Phase.SAVED, 30),
        "loading checkpoint from /tmp/c at iteration 30": (Phase.LOADING, 30),
        "resumed from checkpoint at iteration 30 at DP 2 (saved at DP 3)": (Phase.LOADED, 30),
        "iteration 30/ 40 | checkpoint": None,
    }
    assert {line: parse_checkpoint_line(line) for line in lines} == lines


def test_iterations_made_again_are_timed_without_the_saves_made_meanwhile():
    """As the restart test above (31..50 made again at 1 s each), with a 9 s save during the
    relaunch's 69 iterations: an iteration counts (69 - 9) / 69 s, so 20 made again are 17.4 s (not
    20 s, of which the save's share), and the save is the checkpoint's."""
    track = _track([(10.0, 1), (59.0, 50)], [(80.0, 31), (149.0, 100)])
    _said(track, 1, (Phase.SAVING, 100.0), (Phase.SAVED, 109.0))
    spent = ledger(track, began=0.0, ended=150.0).seconds
    assert spent[Cause.RECOMPUTED] == pytest.approx(20 * 60 / 69) and spent[Cause.CHECKPOINT] == 9.0
    assert spent[Cause.TRAINING] == pytest.approx(49 + 69 + 60 / 69 - 20 * 60 / 69 - 9)
    assert sum(spent.values()) == pytest.approx(150.0)
    cut = _track([(10.0, 1), (59.0, 50)])
    cut.checkpoint(Phase.SAVING, 58.0)  # the failure cut it short
    cut.relaunched()
    cut.checkpoint(Phase.SAVING, 100.0)
    cut.checkpoint(Phase.SAVED, 101.0)
    assert [(s.start, s.end) for s in cut.stalls] == [(100.0, 101.0)]
    ranks = GoodputTrack()  # every rank saving its part: from the first's start to the last's end
    for phase, at, rank in ((Phase.SAVING, 10.0, 0), (Phase.SAVING, 10.5, 1), (Phase.SAVED, 11.0, 0)):
        ranks.checkpoint(phase, at, rank)
    assert ranks.stalls == []
    ranks.checkpoint(Phase.SAVED, 12.0, 1)
    ranks.checkpoint(Phase.SAVED, 12.5, 1)  # a repeat: nothing open
    assert [(s.start, s.end) for s in ranks.stalls] == [(10.0, 12.0)]


def test_iterations_made_again_are_timed_at_their_own_pace_not_the_attempts_mean():
    """Made again 31..50 at 1 s each (caught up at 99 s), then slower (a straggler): the 20 made
    again are 20 s, not 20 at the attempt's mean pace."""
    track = _track([(10.0, 1), (59.0, 50)], [(80.0, 31), (99.0, 50), (200.0, 100)])
    spent = ledger(track, began=0.0, ended=200.0).seconds
    assert spent[Cause.RECOMPUTED] == pytest.approx(20.0) and spent[Cause.RESTARTS] == pytest.approx(20.0)


def test_a_straggler_costs_nothing_of_the_checkpoints_saved_while_it_was_slow():
    """Named slow (2x) from 20 s to 60 s, with a 10 s save inside: 30 s of training at half speed."""
    track = _track([(10.0, 1), (90.0, 81)])
    track.straggler(3, since=20.0, slowdown=2.0)
    _said(track, 0, (Phase.SAVING, 30.0), (Phase.SAVED, 40.0))
    track.recovered(3, until=60.0)
    spent = ledger(track, began=0.0, ended=90.0).seconds
    assert spent[Cause.STRAGGLER] == pytest.approx(15.0) and spent[Cause.CHECKPOINT] == pytest.approx(10.0)
