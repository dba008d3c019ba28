"""File descriptors at scale: the driver's node probes hold a socket per node in flight, the output
sink a file per rank. The usual soft limit is 1,024 (the hard one much higher); Ray raises its own
processes' soft limit to the hard one, and so does megaray, for the processes it runs, when a job
needs more."""

from __future__ import annotations

import contextlib
import resource

SPARE_FDS = 256  # descriptors left for everything else a process opens (Ray's own)


def fd_budget(wanted: int) -> int:
    """How many descriptors this process may use for `wanted` things: up to `wanted`, within its
    limit, the soft limit raised towards the hard one if need be."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    if soft < wanted + SPARE_FDS:
        target = wanted + SPARE_FDS if hard == resource.RLIM_INFINITY else min(hard, wanted + SPARE_FDS)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return max(16, min(wanted, soft - SPARE_FDS))
