"""Processes megaray started, told apart from everyone else's: megaray signals a process only by a
pid it recorded, and only while that pid is still the process it started (same start time), never
by a name or a command-line match (`megaray down` once killed a user's `tail -f` of a Ray log because
its command line named the cluster's folder).

A node of `megaray up` is a `ray start --block` started in a session of its own; every Ray process
of that node (GCS, raylet, agents, workers, the reaper) is started inside that session, so the
session's members that started after its leader are the node's, whatever their command lines say.
"""

from __future__ import annotations

from pathlib import Path

from ...rank.probes import Stat, stat


def session_members(leader: int, started: int | None) -> list[Stat]:
    """The running processes of the session `leader` started (itself included, while it runs),
    that started no earlier than it did, by pid; nothing when `leader` is now another process."""
    s = stat(leader)
    if s is not None and started is not None and s.start_ticks != started:
        return []  # the pid was reused: that session is someone else's
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        m = stat(int(entry.name))
        if m is None or m.session != leader or m.state == "Z":
            continue
        if started is not None and m.start_ticks < started:
            continue
        found.append(m)
    return sorted(found, key=lambda m: m.pid)
