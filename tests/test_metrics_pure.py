"""The metrics' decisions without Ray (core/metrics.py): what a rank's reports and samples give, a
node's aggregate, the ranks' parallel coordinates and labels, and what the label set costs."""

from __future__ import annotations

import pytest

from launcher.core import metrics as m
from launcher.core.layout import ParallelDims
from launcher.core.metrics import MetricsMode, RankTrack
from launcher.core.straggler import StepSample, WaitSample
from launcher.driver.output.metrics import JobMetrics


def test_a_ranks_step_time_tokens_and_mfu_come_from_its_reports_since_the_last_export():
    track = RankTrack(world_size=4, peak_tflops=1000.0)
    track.report({"iteration": 10, "time": 100.0, "loss": 2.5, "lr": 1e-4})
    assert track.window() == {m.ITERATION: 10.0, m.LAST_PROGRESS: 100.0, m.LOSS: 2.5, m.LEARNING_RATE: 1e-4}
    for it in range(11, 15):  # four more iterations, 0.5 s each, before the next export
        track.report({"iteration": it, "time": 100.0 + 0.5 * (it - 10), "tokens": 8000, "flops": 4e15})
    figures = track.window()
    assert figures[m.STEP_SECONDS] == 0.5 and figures[m.ITERATION] == 14.0
    assert figures[m.TOKENS_PER_S] == 8000 / 4 / 0.5  # this rank's share of the world's tokens
    assert figures[m.TFLOPS] == pytest.approx(4e15 / 4 / 0.5 / 1e12)
    assert figures[m.MFU] == pytest.approx(2.0)  # 2000 TFLOP/s against a peak of 1000
    # nothing new: the figures stay (a hung rank keeps its last progress); a slower window changes them
    assert track.window()[m.STEP_SECONDS] == 0.5
    track.report({"iteration": 15, "time": 104.0})
    assert track.window()[m.STEP_SECONDS] == 2.0
    # a relaunch resumes from a checkpoint at a lower iteration: timed from there
    track.report({"iteration": 5, "time": 200.0})
    track.report({"iteration": 7, "time": 201.0})
    assert track.window()[m.STEP_SECONDS] == 0.5


def test_timed_forward_steps_give_the_step_time_and_samples_gpu_memory():
    track = RankTrack(world_size=4, peak_tflops=1000.0)
    track.sample(WaitSample(3, 0.0, 25, 10), at=40.0)
    assert track.window() == {}  # looks at a stack are not progress
    track.sample(StepSample(3, 0.0, 1, steps=4, seconds=2.0, memory=(5, 8)), at=50.0)
    track.sample(StepSample(3, 0.0, 1, steps=4, seconds=6.0), at=52.0)
    assert track.window() == {
        m.STEP_SECONDS: 1.0,
        m.LAST_PROGRESS: 52.0,
        m.GPU_ALLOCATED: 5.0,
        m.GPU_RESERVED: 8.0,
    }


def test_a_node_is_as_slow_as_its_slowest_rank_and_its_tokens_are_its_ranks_sum():
    node = m.node_values({
        0: {m.STEP_SECONDS: 0.5, m.TOKENS_PER_S: 100.0, m.LAST_PROGRESS: 10.0, m.LOSS: 2.0},
        1: {m.STEP_SECONDS: 0.9, m.TOKENS_PER_S: 50.0, m.LAST_PROGRESS: 4.0, m.LOSS: 3.0},
    })  # fmt: skip
    assert node == {m.STEP_SECONDS: 0.9, m.TOKENS_PER_S: 150.0, m.LAST_PROGRESS: 4.0, m.LOSS: 2.5}


def test_coordinates_follow_megatrons_order_tensor_parallel_fastest_pipeline_slowest():
    # TP 2 x PP 2 on 8 ranks: DP 2; ranks 0-3 are stage 0
    got = [m.coordinates(r, 8, ParallelDims(tp=2, pp=2)) for r in range(8)]
    assert [(c["tp"], c["dp"], c["pp"]) for c in got] == [
        ("0", "0", "0"), ("1", "0", "0"), ("0", "1", "0"), ("1", "1", "0"),
        ("0", "0", "1"), ("1", "0", "1"), ("0", "1", "1"), ("1", "1", "1"),
    ]  # fmt: skip
    assert m.coordinates(0, 6, ParallelDims(tp=4)) == {
        "tp": "",
        "pp": "",
        "dp": "",
    }  # does not divide: unknown


def test_labels_name_each_rank_and_its_node_or_under_metrics_node_the_node_alone():
    where = [("n1", "10.0.0.1"), ("n1", "10.0.0.1"), ("n2", "10.0.0.2"), ("n2", "10.0.0.2")]
    labels = m.rank_labels("j", MetricsMode.RANK, where, ParallelDims(tp=2), 989.0)
    assert sorted(labels) == ["n1", "n2"] and sorted(labels["n2"].ranks) == [2, 3]
    assert labels["n2"].tags(3) == {
        m.JOB: "j",
        "rank": "3",
        "node": "10.0.0.2",
        "tp": "1",
        "pp": "0",
        "dp": "1",
    }
    per_node = m.rank_labels("j", MetricsMode.NODE, where, None, 989.0)
    assert per_node["n2"].tags(3) == {
        m.JOB: "j",
        "node": "10.0.0.2",
        "rank": "",
        "tp": "",
        "pp": "",
        "dp": "",
    }


def test_what_the_label_set_costs_at_8_and_4096_ranks():
    """The cardinality figures of docs/guides/watching.md: 11 per-rank metrics for each rank (or
    node); the job's 11 gauges and counters, its state for each of 9 states, failures of 5 kinds,
    restarts of 3, goodput of 7 causes."""
    assert m.series_count(8, 1, MetricsMode.RANK) == 8 * 11 + 35 == 123
    assert m.series_count(4096, 512, MetricsMode.RANK) == 4096 * 11 + 35 == 45_091
    assert m.series_count(4096, 512, MetricsMode.NODE) == 512 * 11 + 35 == 5_667
    assert m.series_count(4096, 512, MetricsMode.OFF) == 0


def test_metrics_off_records_nothing_and_needs_no_ray():
    job = JobMetrics("j", MetricsMode.OFF)
    assert job.kept is None
    job.on_state(m.LaunchState.RUNNING)
    job.scores({0: 2.0})
    job.close()
