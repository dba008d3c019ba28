"""CPU-seconds by kind of process, for the whole run: `python -m pytest -p tests.cpu_by_process`.

tests/cpu_per_test.py says which test spent the CPU; this says which processes did (the ranks, the
drivers, Ray's agents and daemons, the output forwarders, torchrun's workers), every one of them:
the kernel's process accounting (acct(2), root only) writes a record for each process as it exits,
however short it lived, where sampling /proc every 0.25 s missed the short ones and the last
moments of the rest. A process names itself in its record (Ray's set their titles: `ray::RankActor`,
`ray::DashboardA`, `gcs_server`, `raylet`; megaray's drivers and the tests' own programs are
`python`), cut to 15 characters.

The accounting is the machine's: whatever else runs meanwhile is counted too. A process still
running when the run ends has no record. The records go to MEGARAY_ACCT_FILE (default: the temp
dir's megaray-acct); the run ends with the table.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

_RECORD = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")  # struct acct_v3 (linux/acct.h), 64 bytes
_TICKS = 100  # AHZ: the records count clock ticks at 100 a second whatever the kernel's HZ
_on: Path | None = None


def _comp(value: int) -> int:
    """A comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def records(data: bytes) -> Iterator[tuple[str, float]]:
    """(name, CPU-seconds: user and system) of each process in `data`, a file of acct_v3 records."""
    for offset in range(0, len(data) - _RECORD.size + 1, _RECORD.size):
        fields = _RECORD.unpack_from(data, offset)
        utime, stime, comm = fields[10], fields[11], fields[-1]
        yield comm.split(b"\0")[0].decode(errors="replace"), (_comp(utime) + _comp(stime)) / _TICKS


def by_name(data: bytes) -> list[tuple[str, int, float]]:
    """(name, processes, CPU-seconds), most CPU first."""
    totals: dict[str, list[float]] = {}
    for name, cpu in records(data):
        total = totals.setdefault(name, [0, 0.0])
        total[0] += 1
        total[1] += cpu
    return sorted(((n, int(c), s) for n, (c, s) in totals.items()), key=lambda row: -row[2])


def _acct(path: Path | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(None if path is None else os.fsencode(path)) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def pytest_configure(config):
    global _on
    if hasattr(config, "workerinput"):  # the run's first process turns it on, for every worker
        return
    path = Path(os.environ.get("MEGARAY_ACCT_FILE") or Path(tempfile.gettempdir()) / "megaray-acct")
    path.write_bytes(b"")
    try:
        _acct(path)
    except OSError as e:
        print(f"cpu_by_process: not counting ({e}; needs root)")
        return
    _on = path
    atexit.register(_off)  # a run that ends before its summary (Ctrl-C, a crash) turns it off too


def _off() -> None:
    with contextlib.suppress(OSError):
        _acct(None)


def pytest_terminal_summary(terminalreporter, config):
    global _on
    if _on is None:
        return
    _acct(None)
    rows = by_name(_on.read_bytes())
    _on = None
    terminalreporter.section("CPU-seconds by process (tests/cpu_by_process.py)")
    for name, count, cpu in rows[:30]:
        terminalreporter.write_line(f"{cpu:8.1f} cpu-s {count:6d} processes {cpu / count:6.2f} each  {name}")
    total = sum(cpu for _, _, cpu in rows)
    terminalreporter.write_line(f"{total:8.1f} cpu-s in {sum(c for _, c, _ in rows)} processes")
