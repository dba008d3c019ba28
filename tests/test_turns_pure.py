"""Which turn a test takes between the pytest-xdist workers (tests/turns.py), read from its markers by
conftest.py's `turn_of`: a marker misread would let a test that times ranks run beside a busy one."""

import pytest

from .conftest import turn_of
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


def _hold(kind: Turn, seconds: float, events, name: str, shared: str) -> None:
    import os
    import time
    from pathlib import Path

    from . import turns

    os.environ["PYTEST_XDIST_TESTRUNUID"] = "turns-pure-check"
    with turns.turn(kind, Path("/nonexistent-group"), Path(shared)):  # no cgroup of its own: none lowered
        events.put((name, "in"))
        time.sleep(seconds)
        events.put((name, "out"))  # before the turn is given up: the other's "in" can only follow


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
    import multiprocessing

    events = multiprocessing.Queue()
    a = multiprocessing.Process(target=_hold, args=(first, 0.5, events, "first", str(tmp_path)))
    a.start()
    assert events.get(timeout=30) == ("first", "in")
    b = multiprocessing.Process(target=_hold, args=(second, 0.0, events, "second", str(tmp_path)))
    b.start()
    a.join(30)
    b.join(30)
    order = [events.get(timeout=5) for _ in range(3)]
    assert (order.index(("second", "in")) < order.index(("first", "out"))) is beside, order
