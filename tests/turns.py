"""Whose turn the CPU is, between the pytest-xdist workers (three on 2 cores: pyproject.toml).

Tests that time ranks against each other (a straggler named, a slow rank dropped, a machine busy on
purpose, the doctor's bandwidth) are marked `alone`: the other worker's load would starve a rank and
the test would rightly name it (seen in one of three fresh-clone runs).

Where this machine lets us (root and cgroup v1's `cpu` controller, as on CI's machines), each worker
runs in a CPU cgroup of its own, which every process it starts inherits (Ray's daemons, drivers,
ranks, a `megaray up` that left its session): an `alone` test lowers the other workers' CPU weights
to a quarter of its own between them while it runs, so where all want a core, its ranks get four
fifths of it, and the other workers go on with their tests on what is left instead of waiting.
Waiting cost the run 75-150 s of one worker's time (its test under way had to end before the
`alone` test could start, then it sat idle while the `alone` test, which uses 0.7-1.9 cores, ran).
A test that makes the machine busy on purpose (`alone(busy=True)`) takes the turn, so that no test
that times ranks runs beside it, but lowers nobody (`Turn.BUSY`). A test that mostly waits out
a bound in seconds (`quiet`) is kept from the busy ones alone. A Ray's start inside a test
(`others_lowered`: Ray's 30 s for a node) waits for the `alone` tests, and lowers every other worker,
a busy one too, instead of waiting for it (`Turn.STARTING`).

Elsewhere every test holds a shared lock for its whole run (set-up, the module's cluster included,
and teardown) and an `alone` test holds it exclusively, so the other worker waits between two of its
tests; a turnstile taken first keeps the other worker's stream of tests from starving the exclusive
one.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

_CPU = Path("/sys/fs/cgroup/cpu")
_SHARES = 1024  # the kernel's default weight
_LOWERED = _SHARES // 4  # the other workers' weight together, while an `alone` test or a Ray's start runs
_holding = False  # this worker has the `alone` turn: a turn asked inside it (others_lowered) has it too
WAITED_S = 1.0  # a wait for a turn at least this long is kept in `waited`
# (the test, what it asked, seconds): each wait for a turn of WAITED_S or more in this worker, for
# tests/cpu_per_test.py, which tells waits between tests but not those inside one (a Ray's start)
waited: list[tuple[str, str, float]] = []


def _flock(file, how: int, asked: Turn) -> None:
    t0 = time.monotonic()
    fcntl.flock(file, how)
    if (spent := time.monotonic() - t0) >= WAITED_S:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        waited.append((test, asked.value, spent))


class Turn(enum.Enum):
    """What a test asks of the other workers (its markers: conftest.py's `turn_of`)."""

    SHARED = "shared"  # nothing: it runs beside anything
    ALONE = "alone"  # `alone`: one at a time, the other workers lowered
    BUSY = "busy"  # `alone(busy=True)`: one at a time with the `alone` ones, nobody lowered, no quiet one
    QUIET = "quiet"  # `quiet`: never beside a busy one; beside anything else
    STARTING = "starting"  # a Ray's start inside a test (`others_lowered`): never beside an `alone` test,
    # the other workers lowered, a busy one too


def _run() -> str | None:
    return os.environ.get("PYTEST_XDIST_TESTRUNUID")


def _group(run: str, worker: str) -> Path:
    """A worker's group (`worker` "*": every worker's of this run, for a glob)."""
    return _CPU / f"megaray-tests-{run[:12]}-{worker}"


def join_own_group() -> Path | None:
    """This worker's CPU cgroup, with this process in it; None where there is none to make (not
    root, no cgroup v1 `cpu` controller, not under pytest-xdist). Earlier runs' emptied groups go."""
    run, worker = _run(), os.environ.get("PYTEST_XDIST_WORKER")
    if not run or not worker or not (_CPU / "cpu.shares").exists():
        return None
    ours = set(_CPU.glob(_group(run, "*").name))
    for old in set(_CPU.glob("megaray-tests-*")) - ours:
        with contextlib.suppress(OSError):
            old.rmdir()  # fails while a process is left in it: harmless
    group = _group(run, worker)
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.shares").write_text(str(_SHARES))
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


def _set_others(run: str, own: Path, lowered: bool) -> None:
    """Every other worker's weight: lowered, their share of `_LOWERED` (the kernel takes 2 at least),
    else the default again."""
    others = [group for group in _CPU.glob(_group(run, "*").name) if group != own]
    each = max(2, _LOWERED // max(1, len(others))) if lowered else _SHARES
    for group in others:
        with contextlib.suppress(OSError):  # a worker that ended and took its group
            (group / "cpu.shares").write_text(str(each))


@contextlib.contextmanager
def turn(kind: Turn, own: Path | None, shared_tmp: Path) -> Iterator[None]:
    """Around one test (its set-up and teardown included). An `alone` test lowers the other workers;
    one that makes the machine busy on purpose (BUSY) does not: its subject needs the machine busy,
    which the other workers' load only adds to, and lowered beside it a Ray start in another worker
    overran Ray's hard-coded 30 s (test_demo's local `--nodes 2` launch beside the sixteen-ranks test:
    three runs of three, their modules together).

    QUIET: a test that mostly waits, with a bound in seconds, is never beside a BUSY one, and takes no
    turn from anything else: it lowers nobody, and the other workers' Ray starts and `alone` tests go
    on beside it. (test_addresses was `alone`: while its cases waited out their bounds, the other
    workers' Ray starts waited for them, ~40 s of a worker idle in a run.) A quiet test's own Ray
    start (STARTING) never waits on a busy test, which waits on the quiet test.

    STARTING (a Ray's start inside a test, `others_lowered`) waits for an `alone` test, not for a busy
    one: it lowers every other worker, the busy test's too, so that its node registers within Ray's
    30 s while the machine stays busy. As an `alone` turn it waited for both busy tests: 50 s of one
    worker's time in a fresh-clone run (test_up's `megaray up`). The locks: `busy` (BUSY exclusive,
    QUIET shared), `timed` (ALONE and BUSY: never together), `alone` (ALONE and STARTING), each taken
    in that order."""
    run = _run()
    if not run:  # one process: nothing runs beside the test
        yield
        return
    base = shared_tmp / f"megaray-tests-{run}"
    if own is not None:
        global _holding
        if kind is Turn.QUIET:
            with open(f"{base}.busy", "a") as busy_lock:
                _flock(busy_lock, fcntl.LOCK_SH, kind)  # never beside a busy test; beside the others
                yield
            return
        # inside a turn held already: a second flock of the file from this process would wait for ever
        if kind is Turn.SHARED or _holding:
            yield
            return
        lower = kind is not Turn.BUSY
        with (
            open(f"{base}.busy", "a") as busy_lock,
            open(f"{base}.timed", "a") as timed,
            open(f"{base}.alone", "a") as lock,
        ):
            if kind is Turn.BUSY:
                _flock(busy_lock, fcntl.LOCK_EX, kind)  # no quiet test beside it
            if kind is not Turn.STARTING:
                _flock(timed, fcntl.LOCK_EX, kind)  # no `alone` test beside a busy one
            if kind is not Turn.BUSY:
                _flock(lock, fcntl.LOCK_EX, kind)  # one `alone` test or Ray start at a time
            if lower:
                _set_others(run, own, lowered=True)
            _holding = True
            try:
                yield
            finally:
                _holding = False
                if lower:
                    _set_others(run, own, lowered=False)
        return
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.lock", "a") as lock:
        exclusive = kind is not Turn.SHARED  # quiet too: on its own, where the turns are locks
        _flock(turnstile, fcntl.LOCK_EX, kind)
        _flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, kind)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@contextlib.contextmanager
def others_lowered(own: Path | None, shared_tmp: Path) -> Iterator[None]:
    """The other workers lowered for a stretch inside a test that is not `alone` as a whole: a step
    with a time bound the test does not set (Ray gives a node's raylet 30 s to register, a hard-coded
    bound that a loaded machine passes). After any `alone` test of the other workers, as those are
    after each other; beside a busy one, lowered too (`Turn.STARTING`). Nothing where the turns are
    locks: the test holds its shared one, and the exclusive one would wait for it for ever."""
    if own is None:
        yield
        return
    with turn(Turn.STARTING, own, shared_tmp):
        yield
