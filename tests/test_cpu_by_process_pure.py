"""tests/cpu_by_process.py's reading of the kernel's acct_v3 records (linux/acct.h)."""

from __future__ import annotations

import struct

from .cpu_by_process import by_name, records


def _record(comm: bytes, utime: int, stime: int) -> bytes:
    """One acct_v3 record as the kernel writes it: flag, version 3, tty, exit code, uid, gid, pid,
    ppid, start time, elapsed (a float), then comp_t times and counters, then the name."""
    return struct.pack("<BBHIIIIIIfHHHHHHHH16s", 0, 3, 0, 0, 0, 0, 42, 1, 0, 1.5, utime, stime,
                       0, 0, 0, 0, 0, 0, comm)  # fmt: skip


def test_times_are_comp_t_ticks_and_names_end_at_the_first_nul():
    # comp_t 0x2001: mantissa 1, exponent 1 (x8) = 8 ticks; 250 ticks as they are: 2.58 s
    data = _record(b"ray::RankActor.\0", 250, 0x2001) + _record(b"raylet\0junk", 10, 0)
    assert list(records(data)) == [("ray::RankActor.", 2.58), ("raylet", 0.1)]


def test_processes_add_up_by_name_most_cpu_first():
    data = _record(b"python", 100, 0) + _record(b"raylet", 300, 0) + _record(b"python", 50, 50)
    assert by_name(data) == [("raylet", 1, 3.0), ("python", 2, 2.0)]
