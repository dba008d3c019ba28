"""CPU-seconds per test, for finding what makes the suite slow: `python -m pytest -p tests.cpu_per_test`.

On 2 cores the suite keeps both busy (its workers, Ray's daemons, every rank), so a test's wall
time says more about what ran beside it than about the test. Here each pytest process (each xdist
worker) moves into a cgroup of its own, which every process it starts inherits (Ray's daemons,
drivers, ranks): the cgroup's CPU counter read before and after each test is what that test cost,
whatever ran beside it. Module fixtures count in the test that started or stopped them.

Needs root and a cgroup filesystem (v1 `cpuacct` or v2); without them it says so and records nothing.
Each worker appends `nodeid<TAB>cpu_s<TAB>wall_s<TAB>started` (seconds since the epoch: the
workers' lines side by side show when one waited) to `cpu-<worker>.tsv` in MEGARAY_CPU_DIR (default:
the temp dir); the run ends with the modules' totals, then each worker's time outside its tests
(waits for an `alone` test's turn, between tests) and how long the run went on after its last test:
one fresh-clone run sat idle for its last ~290 s (2026-12-06, outside every test's phases; not seen
again), which only a record of the time between tests shows.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

import pytest

from . import turns

_V1 = Path("/sys/fs/cgroup/cpuacct")
_V2 = Path("/sys/fs/cgroup")
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")


def _out_dir() -> Path:
    return Path(os.environ.get("MEGARAY_CPU_DIR") or tempfile.gettempdir())


class _Counter:
    """This process's own cgroup and its CPU counter, in seconds."""

    def __init__(self) -> None:
        if (_V1 / "cpuacct.usage").exists():
            self.dir, self.read = _V1 / f"megaray-cpu-{_WORKER}-{os.getpid()}", self._v1
        elif (_V2 / "cgroup.controllers").exists():
            self.dir, self.read = _V2 / f"megaray-cpu-{_WORKER}-{os.getpid()}", self._v2
        else:
            raise OSError("no cgroup filesystem with a CPU counter under /sys/fs/cgroup")
        for old in self.dir.parent.glob("megaray-cpu-*"):  # earlier runs': removed once empty
            with contextlib.suppress(OSError):
                old.rmdir()
        self.dir.mkdir(exist_ok=True)
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def _v1(self) -> float:
        return int((self.dir / "cpuacct.usage").read_text()) / 1e9

    def _v2(self) -> float:
        stat = dict(line.split() for line in (self.dir / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6


_counter: _Counter | None = None
_session_started = time.time()
GAP_S = 5.0  # time between a worker's two tests worth naming


def pytest_configure(config):
    global _counter
    # made if missing, once per process (a run that named a new one lost its workers to an internal
    # error at the first test's record)
    _out_dir().mkdir(parents=True, exist_ok=True)
    if not hasattr(config, "workerinput"):  # the run's first process: an earlier run's counts go
        for old in [*_out_dir().glob("cpu-*.tsv"), *_out_dir().glob("waits-*.tsv")]:
            old.unlink()
    try:
        _counter = _Counter()
    except OSError as e:
        print(f"cpu_per_test: not counting ({e}; needs root)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _counter is None:
        yield
        return
    cpu, wall, started = _counter.read(), time.monotonic(), time.time()
    yield
    cpu, wall = _counter.read() - cpu, time.monotonic() - wall
    with open(_out_dir() / f"cpu-{_WORKER}.tsv", "a") as f:
        f.write(f"{item.nodeid}\t{cpu:.1f}\t{wall:.1f}\t{started:.1f}\n")
    if turns.waited:  # most tests waited for nothing: no file opened for them
        with open(_out_dir() / f"waits-{_WORKER}.tsv", "a") as f:
            while turns.waited:
                f.write("\t".join(map(str, turns.waited.pop(0))) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    by_module: dict[str, list[float]] = {}
    spans: dict[str, list[tuple[float, float]]] = {}
    for tsv in sorted(_out_dir().glob("cpu-*.tsv")):
        for line in tsv.read_text().splitlines():
            nodeid, cpu, wall, started = line.split("\t")[:4]
            total = by_module.setdefault(nodeid.split("::")[0], [0.0, 0.0])
            total[0] += float(cpu)
            total[1] += float(wall)
            spans.setdefault(tsv.stem.removeprefix("cpu-"), []).append((float(started), float(wall)))
    if not by_module:
        return
    terminalreporter.section("CPU-seconds per module (tests/cpu_per_test.py)")
    for module, (cpu, wall) in sorted(by_module.items(), key=lambda kv: -kv[1][0]):
        terminalreporter.write_line(f"{cpu:8.1f} cpu-s {wall:8.1f} s  {module}")
    terminalreporter.write_line(f"{sum(c for c, _ in by_module.values()):8.1f} cpu-s in all")
    for line in outside_tests(spans, _session_started, time.time()):
        terminalreporter.write_line(line)
    for line in turn_waits(sorted(_out_dir().glob("waits-*.tsv"))):
        terminalreporter.write_line(line)


def _short(test: str) -> str:
    """A test's name, cut; none for a wait before a test's own start (its turn, between tests)."""
    return test.split("::")[-1][:60] or "between tests"


def turn_waits(files: list[Path]) -> list[str]:
    """Each worker's waits for a turn (tests/turns.py) of a second or more, in all and the longest
    three: a test that waits inside itself (a Ray's start waiting for an `alone` test to end) shows
    no gap between tests, and its worker sits idle all the same."""
    lines = []
    for tsv in files:
        waits = [line.split("\t") for line in tsv.read_text().splitlines()]
        longest = sorted(waits, key=lambda w: -float(w[2]))[:3]
        named = ", ".join(f"{float(s):.0f} s {_short(test)} ({asked})" for test, asked, s in longest)
        worker = tsv.stem.removeprefix("waits-")
        lines.append(
            f"{worker}: {len(waits)} wait(s) for a turn, {sum(float(w[2]) for w in waits):.0f} s: {named}"
        )
    return lines


def outside_tests(spans: dict[str, list[tuple[float, float]]], began: float, now: float) -> list[str]:
    """Each worker's time outside its tests (before its first, gaps of GAP_S or more between two,
    after its last), and the run's time after every worker's last test, from (started, wall) pairs."""
    lines, ends = [], []
    for worker, tests in sorted(spans.items()):
        tests.sort()
        first, end, gaps = tests[0][0], tests[0][0], []
        for started, wall in tests:
            if started - end >= GAP_S:
                gaps.append(started - end)
            end = max(end, started + wall)
        ends.append(end)
        lines.append(
            f"{worker}: first test at {first - began:.0f} s, {len(gaps)} gap(s) of {GAP_S:g} s or more "
            f"between tests ({sum(gaps):.0f} s, the longest {max(gaps, default=0):.0f} s), last test "
            f"ended at {end - began:.0f} s"
        )
    after = now - max(ends)
    lines.append(f"the run went on {after:.0f} s after its last test ended ({now - began:.0f} s in all)")
    return lines
