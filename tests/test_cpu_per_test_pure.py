"""tests/cpu_per_test.py's account of the time outside the tests: a worker's waits between its
tests, and a run that goes on after its last test (one fresh-clone run sat idle for its last ~290 s,
which no test's phases showed)."""

from __future__ import annotations

from .cpu_per_test import outside_tests, turn_waits


def test_gaps_between_a_workers_tests_and_the_runs_tail_are_said():
    spans = {"gw1": [(141.0, 3.0), (101.0, 40.0)], "gw0": [(100.0, 10.0), (112.0, 5.0), (130.0, 20.0)]}
    assert outside_tests(spans, began=99.0, now=200.0) == [
        "gw0: first test at 1 s, 1 gap(s) of 5 s or more between tests (13 s, the longest 13 s), last test "
        "ended at 51 s",  # the 2 s between its first two tests are not a gap
        "gw1: first test at 2 s, 0 gap(s) of 5 s or more between tests (0 s, the longest 0 s), last test "
        "ended at 45 s",
        "the run went on 50 s after its last test ended (101 s in all)",
    ]


def test_a_workers_waits_for_a_turn_are_added_up_and_the_longest_named(tmp_path):
    (tmp_path / "waits-gw0.tsv").write_text(
        "tests/test_up.py::test_a\talone\t1.5\n"
        "tests/test_up.py::test_b\tbusy\t30.25\n"
        "\tshared\t2.0\n"
        "tests/test_x.py::test_d\tquiet\t12.0\n"
    )
    assert turn_waits([tmp_path / "waits-gw0.tsv"]) == [
        "gw0: 4 wait(s) for a turn, 46 s: 30 s test_b (busy), 12 s test_d (quiet), 2 s between tests (shared)"
    ]
