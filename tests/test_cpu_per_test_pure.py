"""tests/cpu_per_test.py's account of the time outside the tests: a worker's waits between its
tests, and a run that goes on after its last test (one fresh-clone run sat idle for its last ~290 s,
which no test's phases showed)."""

from __future__ import annotations

from .cpu_per_test import outside_tests


def test_gaps_between_a_workers_tests_and_the_runs_tail_are_said():
    spans = {"gw1": [(141.0, 3.0), (101.0, 40.0)], "gw0": [(100.0, 10.0), (112.0, 5.0), (130.0, 20.0)]}
    assert outside_tests(spans, began=99.0, now=200.0) == [
        "gw0: first test at 1 s, 1 gap(s) of 5 s or more between tests (13 s, the longest 13 s), last test "
        "ended at 51 s",  # the 2 s between its first two tests are not a gap
        "gw1: first test at 2 s, 0 gap(s) of 5 s or more between tests (0 s, the longest 0 s), last test "
        "ended at 45 s",
        "the run went on 50 s after its last test ended (101 s in all)",
    ]
