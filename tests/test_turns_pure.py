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
