"""Straggler decisions (core/straggler.py) and what the driver says of them
(driver/supervision/stragglers.py), fed with samples at set times: no processes."""

from __future__ import annotations

import json
import logging

import pytest

from launcher.core.straggler import CONFIRM_S, SLOWER_BY, StepDetector, StepSample, WaitDetector, WaitSample
from launcher.driver.supervision.stragglers import StragglerWatch

EVERY = 2.5  # seconds between a rank's sends, 25 looks each


def feed(detector: WaitDetector, t: float, waiting: dict[int, float]) -> None:
    for rank, fraction in waiting.items():
        detector.add(WaitSample(rank, t, 25, round(25 * fraction)))


def run(detector: WaitDetector, seconds: float, waiting: dict[int, float], start: float = 0.0):
    changes = []
    t = start
    while t < start + seconds:
        t += EVERY
        feed(detector, t, waiting)
        changes.append((t, detector.look(t)))
    return changes


def test_the_rank_its_peers_wait_for_is_named_after_it_stays_slow_with_its_slowdown():
    d = WaitDetector(4)
    changes = run(d, 15, {0: 0.76, 1: 0.72, 2: 0.76, 3: 0.0})
    named = [(t, s) for t, c in changes for s in c.named]
    assert len(named) == 1
    t, s = named[0]
    assert s.rank == 3 and s.since == EVERY and t - s.since >= CONFIRM_S
    assert s.slowdown == pytest.approx(4.0, rel=0.1)  # computes 4x as long per step
    assert "about 4.2x its peers' time per step" in s.describe()
    # the metrics' scores come from the same look, asked for: each rank against its peers' median
    feed(d, 17.5, {0: 0.76, 1: 0.72, 2: 0.76, 3: 0.0})
    scores = d.look(17.5, scores=True).scores
    assert scores[3] == pytest.approx(s.slowdown) and all(scores[r] < 1.2 for r in (0, 1, 2))
    assert d.look(17.5).scores == {}


@pytest.mark.parametrize(
    "waiting",
    [
        {0: 0.35, 1: 0.5, 2: 0.2, 3: 0.42},  # balanced, each waits for whoever was last this step
        {0: 0.1, 1: 0.05, 2: 0.0, 3: 0.12},  # compute-bound, nobody waits much
        {0: 0.7, 1: 0.0, 2: 0.0, 3: 0.0},  # three slow and one fast: not a rank holding up the rest
    ],
)
def test_nobody_is_named_without_a_few_ranks_holding_up_the_rest(waiting):
    assert not any(c.named for _, c in run(WaitDetector(4), 30, waiting))


def test_a_named_rank_that_catches_up_is_said_to_have_recovered_once_its_slow_samples_age_out():
    d = WaitDetector(2)
    run(d, 10, {0: 0.6, 1: 0.0})
    assert list(d.named) == [1]
    changes = run(d, 30, {0: 0.3, 1: 0.3}, start=10)
    recovered = [s.rank for _, c in changes for s in c.recovered]
    assert recovered == [1] and not d.named


def test_nothing_is_decided_until_every_rank_has_sent_enough_looks():
    d = WaitDetector(3)
    for t in (2.5, 5.0, 7.5, 10.0):
        feed(d, t, {0: 0.8, 1: 0.8})  # rank 2 never sent
        assert not d.look(t).named


def test_the_watch_says_the_rank_and_node_and_writes_stragglers_json(tmp_path, caplog):
    now = [0.0]
    watch = StragglerWatch(
        tmp_path, ["10.0.0.1 (a)", "10.0.0.2 (b)"], clock=lambda: now[0], wall_offset=lambda: 0.0
    )
    with caplog.at_level(logging.INFO, logger="megaray"):
        for step in range(1, 6):
            now[0] = step * EVERY
            watch.sample(WaitSample(0, now[0], 25, 18))
            watch.sample(WaitSample(1, now[0], 25, 0))
            watch.look()
        for step in range(6, 20):
            now[0] = step * EVERY
            watch.sample(WaitSample(0, now[0], 25, 8))
            watch.sample(WaitSample(1, now[0], 25, 8))
            watch.look()
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("rank 1 on 10.0.0.2 (b) is slow: about 3.6x") for m in lines), lines
    assert any(m.startswith("rank 1 on 10.0.0.2 (b) is no longer slow") for m in lines), lines
    (record,) = json.loads((tmp_path / "stragglers.json").read_text())
    assert record["rank"] == 1 and record["node"] == "10.0.0.2 (b)" and record["slowdown"] == 3.57
    assert record["since"] == EVERY and record["until"] > record["since"]


def test_samples_are_kept_for_the_window_only_even_when_nothing_can_be_decided():
    d = WaitDetector(3, window_s=7.5)  # rank 2 never sends: no decision, ever
    for i in range(1, 1000):
        feed(d, i * EVERY, {0: 0.8, 1: 0.8})
        d.look(i * EVERY)
    assert max(len(q) for q in d.samples.values()) <= 4


# -- the Megatron target's forward step times (megatron/steptimes.py) --------------------------------


def run_steps(
    detector: StepDetector, seconds: float, step_s: dict[int, tuple[int, float]], start=0.0, places=None
):
    """Every EVERY seconds each rank sends how many forward steps of `step_s[rank] = (stage, s)` it ran
    (at `places[rank]` in its stage's shard: 0 without tensor or context parallelism)."""
    changes, t = [], start
    while t < start + seconds:
        t += EVERY
        for rank, (stage, s) in step_s.items():
            steps = max(1, round(EVERY / s))
            detector.add(StepSample(rank, t, stage, steps, steps * s, place=(places or {}).get(rank, 0)))
        changes.append((t, detector.look(t)))
    return changes


def test_a_ranks_peers_are_its_place_in_the_other_replicas_not_its_tensor_parallel_partners():
    """Ranks of one stage of one replica wait for one another inside every forward step (tensor- and
    context-parallel collectives): the one that waits longest has the longest steps, not the slow
    one. Under TP 2 x PP 2 x DP 1, rank 3 slowed from outside got rank 0 named
    (bench/dashboard_picture.py's run); a rank is compared with its stage and place in the other
    data-parallel replicas only."""
    # TP 2, DP 1: rank 1 slow, rank 0 waiting for it inside its steps: no peers, nobody named
    d = StepDetector(2)
    assert not [s for _, c in run_steps(d, 15, {0: (0, 0.30), 1: (0, 0.12)}, places={1: 1}) for s in c.named]
    # TP 2, DP 2: replica 1 (ranks 2, 3) slow, rank 2 the longer waiting for rank 3: both named
    # against their places in replica 0, whose two ranks never against each other
    times = {0: (0, 0.10), 1: (0, 0.11), 2: (0, 0.30), 3: (0, 0.25)}
    d = StepDetector(4)
    named = {s.rank for _, c in run_steps(d, 15, times, places={1: 1, 3: 1}) for s in c.named}
    assert named == {2, 3}
    assert d.look(15.0, scores=True).scores == pytest.approx({0: 1 / 3, 1: 0.44, 2: 3.0, 3: 2.27}, rel=0.05)


def test_a_rank_whose_forward_steps_take_longer_than_its_stage_peers_is_named_with_both_times():
    # two pipeline stages of three data-parallel ranks; stage 1 runs longer steps (the loss), rank 4
    # 2x its stage peers
    times = {0: (0, 0.10), 1: (0, 0.11), 2: (0, 0.10), 3: (1, 0.20), 4: (1, 0.40), 5: (1, 0.21)}
    d = StepDetector(6)
    changes = run_steps(d, 15, times)
    named = [(t, s) for t, c in changes for s in c.named]
    assert [s.rank for _, s in named] == [4]
    t, s = named[0]
    assert t - s.since >= CONFIRM_S and s.slowdown == pytest.approx(1.95, rel=0.05)
    scores = d.look(changes[-1][0], scores=True).scores  # against the stage's peers, stage 0's too
    assert scores[4] == pytest.approx(1.95, rel=0.05) and scores[0] == pytest.approx(0.95, rel=0.05)
    said = "about 2.0x its peers' time per forward step (400 ms against 205 ms on pipeline stage 1)"
    assert s.describe() == said
    assert s.figures() == {"stage": 1, "step_s": 0.4, "peers_step_s": 0.205}


@pytest.mark.parametrize(
    "times",
    [
        {0: (0, 0.10), 1: (0, 0.12), 2: (0, 0.11), 3: (0, 0.13)},  # balanced, within SLOWER_BY
        {0: (0, 0.10), 1: (1, 0.30)},  # stages of one rank: nobody to compare with
        {0: (0, 0.10), 1: (0, 0.30), 2: (0, 0.30), 3: (0, 0.30)},  # three slow: not a few holding up the rest
    ],
)
def test_no_forward_step_straggler_without_a_few_ranks_slower_than_their_stage_peers(times):
    assert not any(c.named for _, c in run_steps(StepDetector(len(times)), 30, times))


def test_a_forward_step_straggler_that_catches_up_recovers_and_the_threshold_is_the_stated_one():
    d = StepDetector(3)
    run_steps(d, 10, {0: (0, 0.1), 1: (0, 0.1), 2: (0, 0.1 * SLOWER_BY * 1.05)})
    assert list(d.named) == [2]
    changes = run_steps(d, 20, {0: (0, 0.1), 1: (0, 0.1), 2: (0, 0.1 * SLOWER_BY * 0.95)}, start=10)
    assert [s.rank for _, c in changes for s in c.recovered] == [2] and not d.named


def test_the_watch_takes_both_kinds_of_sample_and_keeps_the_step_figures(tmp_path):
    now = [0.0]
    watch = StragglerWatch(
        tmp_path,
        ["10.0.0.1 (a)", "10.0.0.1 (a)", "10.0.0.2 (b)"],
        clock=lambda: now[0],
        wall_offset=lambda: 0.0,
    )
    for step in range(1, 8):
        now[0] = step * EVERY
        for rank, s in ((0, 0.05), (1, 0.05), (2, 0.2)):
            watch.sample(StepSample(rank, now[0], 0, 10, 10 * s))
        watch.look()
    (record,) = json.loads((tmp_path / "stragglers.json").read_text())
    assert record["rank"] == 2 and record["node"] == "10.0.0.2 (b)" and record["slowdown"] == 4.0
    assert record["step_s"] == 0.2 and record["peers_step_s"] == 0.05 and record["stage"] == 0


def test_nothing_is_named_while_megarays_own_spares_load_the_nodes_nor_from_what_they_left(tmp_path):
    """The warm spares' imports run beside the training (driver/lifecycle/attempt.py holds the watch
    meanwhile): ranks slowed by them are not named, then, nor from the samples of that time once the
    spares are ready; a rank slow after that is named as ever, a window later."""
    now = [0.0]
    watch = StragglerWatch(tmp_path, ["n0"] * 3, clock=lambda: now[0], wall_offset=lambda: 0.0)

    def run(seconds: float, slow: float) -> None:
        end = now[0] + seconds
        while now[0] < end:
            now[0] += EVERY
            for rank, s in ((0, 0.05), (1, 0.05), (2, slow)):
                watch.sample(StepSample(rank, now[0], 0, 10, 10 * s))
            watch.look()

    watch.hold(True)  # the spares start
    run(15, slow=0.2)
    watch.hold(False)  # ready
    run(5, slow=0.05)
    assert not watch.found  # the window after the spares is not long enough yet, and balanced
    run(15, slow=0.05)
    assert not watch.found
    run(15, slow=0.2)
    assert [r["rank"] for r in watch.found] == [2]


def test_straggler_detection_is_turned_off_as_other_switches_are():
    from launcher.core.straggler import stragglers_off

    assert all(stragglers_off({"MEGARAY_STRAGGLERS": v}) for v in ("off", "OFF", " Off", "0", "false", "no"))
    assert not any(
        stragglers_off(env) for env in ({}, {"MEGARAY_STRAGGLERS": "on"}, {"MEGARAY_STRAGGLERS": "1"})
    )
