"""Which turn a test takes between the pytest-xdist workers (tests/turns.py), read from its markers by
conftest.py's `turn_of`: a marker misread would let a test that times ranks run beside a busy one."""

import sys

import pytest

from .conftest import REPO, turn_of
from .turns import Turn


class _Item:
    """What `turn_of` asks of a pytest item: its closest marker of a name."""

    def __init__(self, *decorators):
        self._marks = {d.mark.name: d.mark for d in decorators}

    def get_closest_marker(self, name):
        return self._marks.get(name)


@pytest.mark.parametrize(
    ("decorators", "turn"),
    [
        ((), Turn.SHARED),
        ((pytest.mark.slow,), Turn.SHARED),
        ((pytest.mark.alone,), Turn.ALONE),
        ((pytest.mark.alone(busy=False),), Turn.ALONE),
        ((pytest.mark.alone(busy=True),), Turn.BUSY),
        ((pytest.mark.quiet,), Turn.QUIET),
        ((pytest.mark.quiet, pytest.mark.alone), Turn.ALONE),  # alone wins: it keeps the others off
    ],
)
def test_a_tests_markers_give_its_turn(decorators, turn):
    assert turn_of(_Item(*decorators)) is turn


HOLD = """
import sys, time
from pathlib import Path
from tests import turns
kind, seconds, name, shared, log = turns.Turn(sys.argv[1]), float(sys.argv[2]), *sys.argv[3:]
def say(what):
    with open(log, "a") as f:  # appended whole: the file's order is the order things happened
        f.write(f"{name} {what}\\n")
with turns.turn(kind, Path("/nonexistent-group"), Path(shared)):  # no cgroup of its own: none lowered
    say("in")
    time.sleep(seconds)
    say("out")  # before the turn is given up: the other's "in" can only follow
"""


@pytest.mark.parametrize(
    ("first", "second", "beside"),
    [
        (Turn.BUSY, Turn.STARTING, True),  # a Ray's start goes on beside a busy test, lowering it
        (Turn.STARTING, Turn.BUSY, True),
        (Turn.QUIET, Turn.STARTING, True),
        (Turn.BUSY, Turn.ALONE, False),  # a test that times ranks never beside a busy one
        (Turn.ALONE, Turn.STARTING, False),  # nor beside a Ray's start
        (Turn.STARTING, Turn.STARTING, False),
        (Turn.BUSY, Turn.QUIET, False),
    ],
)
def test_which_turns_run_beside_which(tmp_path, first, second, beside):
    """Two workers' turns, each a process of its own taking the locks (tests/turns.py): whether the
    second enters while the first holds its turn."""
    import os
    import subprocess
    import time

    log = tmp_path / "order"
    env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": "turns-pure-check"}

    def hold(kind: Turn, seconds: float, name: str) -> subprocess.Popen:
        argv = [sys.executable, "-c", HOLD, kind.value, str(seconds), name, str(tmp_path), str(log)]
        return subprocess.Popen(argv, cwd=REPO, env=env)

    a = hold(first, 0.5, "first")
    deadline = time.monotonic() + 30
    while "first in" not in (log.read_text() if log.exists() else ""):
        assert a.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    b = hold(second, 0.0, "second")
    assert a.wait(30) == 0 and b.wait(30) == 0
    order = log.read_text().splitlines()
    assert (order.index("second in") < order.index("first out")) is beside, order
