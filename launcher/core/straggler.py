"""Which rank the others wait for, from where each rank's main thread is when sampled (rank/waits.py).

In a synchronous job every step ends in a collective, and a rank that computes longer than its peers
makes each of them wait inside that collective for the difference: the peers' samples land in
`torch.distributed` most of the time, the slow rank's almost never. No code change and no step
boundary is needed to see it; the ratio of the two gives the slow rank's compute per step against
its peers'. Decided here, without processes; the driver feeds it and says what it finds
(driver/stragglers.py).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

# samples older than this are forgotten: the ranks' start (imports, rendezvous) must not dilute the
# figures (with 15 s, peers waiting 75% of each step were seen waiting 50% when their straggler was
# named), and a rank that recovers is seen to
WINDOW_S = 7.5
MIN_SAMPLES = 25  # per rank in the window before anything is decided (2.5 s at 10 samples/s)
PEERS_WAITING_MIN = 0.3  # peers waiting less than this are not held up enough to name anyone
AS_LITTLE_AS = 1 / 3  # a suspect waits at most this fraction of what its peers' median waits
CONFIRM_S = 4.0  # a suspect must stay one this long (two looks) before it is named


@dataclass(frozen=True)
class WaitSample:
    """From one rank: of `samples` looks at its main thread up to `at`, `waiting` were inside a
    collective."""

    rank: int
    at: float
    samples: int
    waiting: int


@dataclass(frozen=True)
class Straggler:
    """A rank its peers wait for."""

    rank: int
    waiting: float  # the fraction of its samples inside a collective
    peers_waiting: float  # the median fraction of the other ranks'
    since: float  # when it was first seen slow

    @property
    def slowdown(self) -> float:
        """Its compute per step against its peers': both run one step each, the peers' time outside
        collectives is their compute, its own the whole step less its (short) waits."""
        return (1.0 - self.waiting) / max(1.0 - self.peers_waiting, 0.02)

    def describe(self) -> str:
        return (
            f"about {self.slowdown:.1f}x its peers' time per step outside collectives (it waits in "
            f"collectives {self.waiting:.0%} of the time, its peers {self.peers_waiting:.0%})"
        )


@dataclass(frozen=True)
class Change:
    """What one look found: ranks newly named slow, and named ranks no longer slow."""

    named: tuple[Straggler, ...] = ()
    recovered: tuple[Straggler, ...] = ()


class StragglerDetector:
    """Holds the last `WINDOW_S` of every rank's samples; `look()` names and un-names ranks."""

    def __init__(self, world_size: int, window_s: float = WINDOW_S):
        self.world_size = world_size
        self.window_s = window_s
        self.samples: dict[int, deque[WaitSample]] = {}
        self.suspect_since: dict[int, float] = {}
        self.named: dict[int, Straggler] = {}

    def add(self, sample: WaitSample) -> None:
        """Kept for the window only, whether or not anything is decided (a rank that never sends, a
        job of one rank): a long job's memory stays flat."""
        q = self.samples.setdefault(sample.rank, deque())
        q.append(sample)
        self._forget(q, sample.at)

    def _forget(self, q: deque[WaitSample], now: float) -> None:
        while q and q[0].at < now - self.window_s:
            q.popleft()

    def fractions(self, now: float) -> dict[int, float] | None:
        """Each rank's waiting fraction over the window; None until every rank has enough samples."""
        for q in self.samples.values():
            self._forget(q, now)
        out = {}
        for rank in range(self.world_size):
            q = self.samples.get(rank, deque())
            n = sum(s.samples for s in q)
            if n < MIN_SAMPLES:
                return None
            out[rank] = sum(s.waiting for s in q) / n
        return out

    def suspects(self, waits: dict[int, float]) -> dict[int, tuple[float, float]]:
        """Ranks that wait far less than their peers while those wait much: rank -> (its, peers')."""
        found = {}
        for rank, mine in waits.items():
            peers = statistics.median(w for r, w in waits.items() if r != rank)
            if peers >= PEERS_WAITING_MIN and mine <= peers * AS_LITTLE_AS:
                found[rank] = (mine, peers)
        # the pattern is a few ranks holding up the rest: when half or more look slow, it is not
        return found if len(found) <= len(waits) // 2 else {}

    def look(self, now: float) -> Change:
        if self.world_size < 2:
            return Change()
        fractions = self.fractions(now)
        if fractions is None:
            return Change()
        found = self.suspects(fractions)
        named, recovered = [], []
        for rank, (mine, peers) in found.items():
            since = self.suspect_since.setdefault(rank, now)
            if rank not in self.named and now - since >= CONFIRM_S:
                self.named[rank] = Straggler(rank, mine, peers, since)
                named.append(self.named[rank])
        for rank in [r for r in self.suspect_since if r not in found]:
            del self.suspect_since[rank]
            if rank in self.named:
                recovered.append(self.named.pop(rank))
        return Change(tuple(named), tuple(recovered))
