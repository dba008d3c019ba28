"""Straggler decisions (core/straggler.py) and what the driver says of them (driver/stragglers.py),
fed with samples at set times: no processes."""

from __future__ import annotations

import json
import logging

import pytest

from launcher.core.straggler import CONFIRM_S, StragglerDetector, WaitSample
from launcher.driver.stragglers import StragglerWatch

EVERY = 2.5  # seconds between a rank's sends, 25 looks each


def feed(detector: StragglerDetector, t: float, waiting: dict[int, float]) -> None:
    for rank, fraction in waiting.items():
        detector.add(WaitSample(rank, t, 25, round(25 * fraction)))


def run(detector: StragglerDetector, seconds: float, waiting: dict[int, float], start: float = 0.0):
    changes = []
    t = start
    while t < start + seconds:
        t += EVERY
        feed(detector, t, waiting)
        changes.append((t, detector.look(t)))
    return changes


def test_the_rank_its_peers_wait_for_is_named_after_it_stays_slow_with_its_slowdown():
    d = StragglerDetector(4)
    changes = run(d, 15, {0: 0.76, 1: 0.72, 2: 0.76, 3: 0.0})
    named = [(t, s) for t, c in changes for s in c.named]
    assert len(named) == 1
    t, s = named[0]
    assert s.rank == 3 and s.since == EVERY and t - s.since >= CONFIRM_S
    assert s.slowdown == pytest.approx(4.0, rel=0.1)  # computes 4x as long per step
    assert "about 4.2x its peers' time per step" in s.describe()


@pytest.mark.parametrize(
    "waiting",
    [
        {0: 0.35, 1: 0.5, 2: 0.2, 3: 0.42},  # balanced, each waits for whoever was last this step
        {0: 0.1, 1: 0.05, 2: 0.0, 3: 0.12},  # compute-bound, nobody waits much
        {0: 0.7, 1: 0.0, 2: 0.0, 3: 0.0},  # three slow and one fast: not a rank holding up the rest
    ],
)
def test_nobody_is_named_without_a_few_ranks_holding_up_the_rest(waiting):
    assert not any(c.named for _, c in run(StragglerDetector(4), 30, waiting))


def test_a_named_rank_that_catches_up_is_said_to_have_recovered_once_its_slow_samples_age_out():
    d = StragglerDetector(2)
    run(d, 10, {0: 0.6, 1: 0.0})
    assert list(d.named) == [1]
    changes = run(d, 30, {0: 0.3, 1: 0.3}, start=10)
    recovered = [s.rank for _, c in changes for s in c.recovered]
    assert recovered == [1] and not d.named


def test_nothing_is_decided_until_every_rank_has_sent_enough_looks():
    d = StragglerDetector(3)
    for t in (2.5, 5.0, 7.5, 10.0):
        feed(d, t, {0: 0.8, 1: 0.8})  # rank 2 never sent
        assert not d.look(t).named


def test_the_watch_says_the_rank_and_node_and_writes_stragglers_json(tmp_path, caplog):
    now = [0.0]
    watch = StragglerWatch(tmp_path, ["10.0.0.1 (a)", "10.0.0.2 (b)"], clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="megaray"):
        for step in range(1, 6):
            now[0] = step * EVERY
            watch.sample(0, now[0], 25, 18)
            watch.sample(1, now[0], 25, 0)
            watch.look()
        for step in range(6, 20):
            now[0] = step * EVERY
            watch.sample(0, now[0], 25, 8)
            watch.sample(1, now[0], 25, 8)
            watch.look()
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("rank 1 on 10.0.0.2 (b) is slow: about 3.6x") for m in lines), lines
    assert any(m.startswith("rank 1 on 10.0.0.2 (b) is no longer slow") for m in lines), lines
    (record,) = json.loads((tmp_path / "stragglers.json").read_text())
    assert record["rank"] == 1 and record["node"] == "10.0.0.2 (b)" and record["slowdown"] == 3.57
    assert record["since"] == EVERY and record["until"] > record["since"]


def test_samples_are_kept_for_the_window_only_even_when_nothing_can_be_decided():
    d = StragglerDetector(3, window_s=7.5)  # rank 2 never sends: no decision, ever
    for i in range(1, 1000):
        feed(d, i * EVERY, {0: 0.8, 1: 0.8})
        d.look(i * EVERY)
    assert max(len(q) for q in d.samples.values()) <= 4
