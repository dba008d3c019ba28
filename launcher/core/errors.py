"""One exception family, so the CLI can map every failure to an exit code and a one-line message.

Bad input and missing resources exit 2 (the user must change a setting); a rank failing exits 1
(the program failed); an interrupted launch exits 130 (SIGINT) or 143 (SIGTERM), as a shell would.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from enum import StrEnum


class MegarayError(Exception):
    """Base class: `str(err)` is the cause and the setting that fixes it."""

    exit_code = 1


class UsageError(MegarayError):
    """The command line or a data file asks for something impossible or unknown."""

    exit_code = 2


class ClusterError(MegarayError):
    """The Ray cluster cannot be reached, or its nodes disagree with the driver."""

    exit_code = 2


class ResourceError(MegarayError):
    """The cluster does not have (or did not free in time) what the layout asks for."""

    exit_code = 2


class Interrupted(MegarayError):
    """The driver got SIGINT or SIGTERM; every rank was stopped."""

    def __init__(self, signum: int, name: str):
        super().__init__(f"interrupted by {name}: stopped every rank and removed the placement groups")
        self.signum, self.name = signum, name
        self.exit_code = 128 + signum

    def __reduce__(self):
        return (Interrupted, (self.signum, self.name))


class FailureKind(StrEnum):
    """How a rank failed. A str, so it reads and is written (JSON, logs) as its value."""

    EXCEPTION = "exception"  # the program raised
    EXIT = "exit"  # sys.exit with a non-zero code
    DIED = "died"  # its process or its node is gone (a signal, the OOM killer, a crash at exit)
    HUNG = "hung"  # no progress, and its process stopped or stuck in the kernel
    WAITING = "waiting"  # no progress, its process running (waiting on a peer, most likely)


@dataclass(frozen=True)
class RankFailure:
    """What one rank's failure looked like from the driver."""

    rank: int
    node_ip: str
    hostname: str
    gpu: str
    kind: FailureKind
    summary: str
    traceback: str = ""
    exit_code: int | None = None
    at: float = 0.0  # wall-clock time of the failure, to pick the root cause across ranks
    last_output: tuple[str, ...] = ()  # a dead rank's last lines, read from its spool after it died
    local_rank: int | None = None
    pid: int | None = None  # the rank's process
    error_file: str = ""  # where the program recorded its error (torch elastic's @record), if it did

    def __post_init__(self):
        object.__setattr__(self, "kind", FailureKind(self.kind))  # a value outside the enum fails here


# A dead process, then a stuck one (stopped, in a hang), before ranks that merely raised or waited.
_ROOT_ORDER = {FailureKind.DIED: 0, FailureKind.HUNG: 1}

# What a rank's collective or store raises when a peer's process or node is gone (gloo, NCCL, the
# TCP store): the consequence of another rank's end, which Ray or megaray's node probes tell a few
# seconds later, not a cause of its own.
_PEER_GONE = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|Connection refused"
    r"|remote process exited|ncclRemoteError|failed to recv|Socket Timeout",
    re.IGNORECASE,
)


def peer_consequence(f: RankFailure) -> bool:
    """Whether a failure is a rank's connection error with a peer (a consequence, not a cause)."""
    return (
        f.kind is FailureKind.EXCEPTION
        and _PEER_GONE.search(f"{f.summary}\n{f.traceback[-4000:]}") is not None
    )


OTHERS_SHOWN = 20  # kinds of failure listed after the root cause: one screen, at any world size


def _grouped(failures: list[RankFailure]) -> list[str]:
    """One line per kind of failure (its summary), its ranks as ranges: a node lost at 8,192 ranks
    takes its 8 ranks and fails 8,184 peers in the same collective, which is two lines, not 8,191."""
    from .topology import format_rank_ranges

    groups: dict[str, list[RankFailure]] = {}
    for f in failures:
        groups.setdefault(f.summary, []).append(f)
    lines = []
    for summary, fs in groups.items():
        if len(fs) == 1:
            lines.append(f"  rank {fs[0].rank} on {fs[0].node_ip}: {summary}")
            continue
        ips = sorted({f.node_ip for f in fs})
        where = ips[0] if len(ips) == 1 else f"{len(ips)} nodes"
        lines.append(f"  ranks {format_rank_ranges(f.rank for f in fs)} ({len(fs)}) on {where}: {summary}")
    return lines


class RankFailedError(MegarayError):
    """One or more ranks failed; the earliest failure is the root cause (as torch elastic reports).

    A rank whose process died comes before ranks that raised: when a process dies its peers fail
    with connection errors, and those can reach the driver before Ray reports the death.
    """

    exit_code = 1

    def __init__(self, failures: list[RankFailure], world_size: int, ending: str = ""):
        self.failures = sorted(failures, key=lambda f: (_ROOT_ORDER.get(f.kind, 2), f.at, f.rank))
        self.world_size = world_size
        self.root = self.failures[0]
        self.ending = ending  # what became of the other ranks, said by whoever handled the failure
        super().__init__(
            f"rank {self.root.rank} on {self.root.node_ip} ({self.root.hostname}) failed: {self.root.summary}"
        )

    def __reduce__(self):  # crosses process boundaries (Ray tasks, multiprocessing) intact
        return (RankFailedError, (self.failures, self.world_size, self.ending))

    def beyond_signals(self) -> set[int]:
        """Ranks whose process cannot act on a SIGTERM (stopped, a zombie, stuck in the kernel, dead or
        on its way out): a kill grace would only be waited out for them."""
        return {f.rank for f in self.failures if f.kind in (FailureKind.HUNG, FailureKind.DIED)}

    def amend(self, failures: list[RankFailure]) -> None:
        """The same failures, told more fully (a dead rank's last output, read after the fact)."""
        RankFailedError.__init__(self, failures, self.world_size, self.ending)

    def report(self) -> str:
        """The block printed at the end of a failed launch: root cause first, with its traceback."""
        r = self.root
        line = "=" * 72
        out = [
            line,
            "megaray: launch failed",
            "Root cause (first failure):",
            f"  rank      : {r.rank} of {self.world_size}",
            f"  what      : {r.summary}",
            f"  node      : {r.node_ip} ({r.hostname})",
        ]
        if r.local_rank is not None:
            out.append(f"  local rank: {r.local_rank}")
        out.append(f"  gpu       : {r.gpu or '-'}")
        if r.pid is not None:
            out.append(f"  pid       : {r.pid}")
        if r.at:  # torchrun's format, the node's local time
            out.append(f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(r.at))}")
        if r.exit_code is not None:
            out.append(f"  exit code : {r.exit_code}")
        if r.error_file:
            out.append(f"  error file: {r.error_file} (on {r.node_ip})")
        if r.last_output:
            out.append(f"  last output (all of it in rank-{r.rank}.log):")
            out.extend("    " + ln for ln in r.last_output)
        # sys.exit(n) is the program's word (argparse's 2): torchrun shows its exit code alone, and
        # summary.json keeps the frames
        if r.traceback and r.kind is not FailureKind.EXIT:
            out.append("  traceback :")
            out.extend("    " + ln for ln in r.traceback.rstrip().splitlines())
        others = _grouped(self.failures[1:])
        if others:
            out.append("Other failures:")
            out.extend(others[:OTHERS_SHOWN])
            if len(others) > OTHERS_SHOWN:
                more = len(others) - OTHERS_SHOWN
                out.append(f"  ... and {more} more kinds of failure (summary.json lists every rank's)")
        if self.ending:
            out.append(self.ending)
        out.append(line)
        return "\n".join(out)
