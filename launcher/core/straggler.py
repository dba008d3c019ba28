"""Which rank the others wait for, decided without processes; the driver feeds it and says what it
finds (driver/supervision/stragglers.py). Two kinds of evidence, one detector each, registered
by the sample they take (`DETECTORS`):

- Where each rank's main thread is when looked at (rank/waits.py), for any program. In a synchronous
  job every step ends in a collective, and a rank that computes longer than its peers makes each of
  them wait inside that collective for the difference: the peers' looks land in `torch.distributed`
  most of the time, the slow rank's almost never. No code change and no step boundary is needed.
- The Megatron target's own forward steps, timed on each rank (megatron/steptimes.py): on a GPU the
  CPU does not wait in the collectives (NCCL runs on the device), so looks at the stack cannot see
  who is slow; the time each forward step takes on the device can. A rank is compared with the
  ranks of its own pipeline stage, which run the same layers.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

OFF_VAR = "MEGARAY_STRAGGLERS"
_OFF = frozenset({"off", "0", "false", "no"})


def stragglers_off(environ: Any) -> bool:
    """Whether the rank's environment turns straggler detection off (`--env MEGARAY_STRAGGLERS=off`;
    any case, and 0/false/no as other switches take them: only `off` exactly did)."""
    return str(environ.get(OFF_VAR, "")).strip().lower() in _OFF


# samples older than this are forgotten: the ranks' start (imports, rendezvous) must not dilute the
# figures (with 15 s, peers waiting 75% of each step were seen waiting 50% when their straggler was
# named), and a rank that recovers is seen to
WINDOW_S = 7.5
CONFIRM_S = 4.0  # a suspect must stay one this long (two looks) before it is named

MIN_SAMPLES = 25  # looks per rank in the window before anything is decided (2.5 s at 10 looks/s)
PEERS_WAITING_MIN = 0.3  # peers waiting less than this are not held up enough to name anyone
AS_LITTLE_AS = 1 / 3  # a suspect waits at most this fraction of what its peers' median waits

MIN_STEPS = 5  # forward steps per rank in the window before its time is compared
# a suspect's forward step takes at least this many times its peers' median: nvidia-resiliency-
# ext's straggler detection flags a GPU below 0.7 of its peers' performance by default (1 / 0.7)
SLOWER_BY = 1.4


@dataclass(frozen=True)
class WaitSample:
    """From one rank (rank/waits.py): of `samples` looks at its main thread, `waiting` were inside a
    collective. `at` is the sink's clock when it arrived (the nodes' clocks need not agree)."""

    rank: int
    at: float
    samples: int
    waiting: int
    memory: tuple[int, int] | None = None  # GPU bytes allocated and reserved, where CUDA is used


@dataclass(frozen=True)
class StepSample:
    """From one rank of the Megatron target (megatron/steptimes.py): `steps` forward steps took
    `seconds` in all; `stage` is its pipeline stage and `place` its place inside the stage's model
    shard (its tensor- and context-parallel ranks, as one number). Its peers are the ranks of the
    same stage and place in the other data-parallel replicas: those of its own stage in its own
    replica wait for one another inside every forward step (tensor- and context-parallel
    collectives), so that the one that waits longest, not the slow one, would look slow."""

    rank: int
    at: float
    stage: int
    steps: int
    seconds: float
    memory: tuple[int, int] | None = None  # GPU bytes allocated and reserved (core/metrics.py)
    place: int = 0


Sample = WaitSample | StepSample


@dataclass(frozen=True)
class Straggler:
    """A rank its peers wait for: `slowdown` is its time per step against theirs."""

    rank: int
    slowdown: float
    since: float

    def describe(self) -> str:
        raise NotImplementedError

    def figures(self) -> dict[str, Any]:
        """What stragglers.json keeps of the evidence."""
        raise NotImplementedError


@dataclass(frozen=True)
class WaitStraggler(Straggler):
    waiting: float  # the fraction of its looks inside a collective
    peers_waiting: float  # the median fraction of the other ranks'

    def describe(self) -> str:
        return (
            f"about {self.slowdown:.1f}x its peers' time per step outside collectives (it waits in "
            f"collectives {self.waiting:.0%} of the time, its peers {self.peers_waiting:.0%})"
        )

    def figures(self) -> dict[str, Any]:
        return {"waiting": round(self.waiting, 3), "peers_waiting": round(self.peers_waiting, 3)}


@dataclass(frozen=True)
class StepStraggler(Straggler):
    stage: int
    step_s: float  # its mean forward step
    peers_step_s: float  # the median of its peers' means (its stage and place in other replicas)

    def describe(self) -> str:
        return (
            f"about {self.slowdown:.1f}x its peers' time per forward step ({_ms(self.step_s)} against "
            f"{_ms(self.peers_step_s)} on pipeline stage {self.stage})"
        )

    def figures(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "step_s": round(self.step_s, 5),
            "peers_step_s": round(self.peers_step_s, 5),
        }


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.0f} s"


@dataclass(frozen=True)
class Change:
    """What one look found: ranks newly named slow, named ranks no longer slow, and (when asked for)
    every rank's score."""

    named: tuple[Straggler, ...] = ()
    recovered: tuple[Straggler, ...] = ()
    scores: dict[int, float] = field(default_factory=dict)


class StragglerDetector:
    """Holds the last `window_s` of every rank's samples; `look()` names a rank that stays a suspect
    for CONFIRM_S and un-names it when it no longer is. A kind of evidence says who is a suspect."""

    sample_type: ClassVar[type]

    def __init__(self, world_size: int, window_s: float = WINDOW_S):
        self.world_size = world_size
        self.window_s = window_s
        self.samples: dict[int, deque[Any]] = {}
        self.suspect_since: dict[int, float] = {}
        self.named: dict[int, Straggler] = {}

    def add(self, sample: Sample) -> None:
        """Kept for the window only, whether or not anything is decided (a rank that never sends, a
        job of one rank): a long job's memory stays flat."""
        q = self.samples.setdefault(sample.rank, deque())
        q.append(sample)
        self._forget(q, sample.at)

    def _forget(self, q: deque[Any], now: float) -> None:
        while q and q[0].at < now - self.window_s:
            q.popleft()

    def window(self, now: float) -> dict[int, deque[Any]]:
        for q in self.samples.values():
            self._forget(q, now)
        return self.samples

    def forget_suspicions(self) -> None:
        """Suspects not yet named start over (their evidence came from a time that does not count)."""
        self.suspect_since = {r: t for r, t in self.suspect_since.items() if r in self.named}

    def compared(self, now: float) -> Any:
        """The window's evidence, each rank's against its peers': worked out once a look, for both
        `suspects` and `scores`."""
        raise NotImplementedError

    def suspects(self, compared: Any) -> dict[int, Straggler]:
        """rank -> what makes it one (`since` is filled in by `look`)."""
        raise NotImplementedError

    def scores(self, compared: Any) -> dict[int, float]:
        """Each rank's time per step against its peers' median (1: as fast), for the ranks with
        enough samples: the metrics' straggler score (core/metrics.py)."""
        raise NotImplementedError

    def look(self, now: float, scores: bool = False) -> Change:
        """`scores`: the Change carries every rank's score too (the job's metrics want them)."""
        if self.world_size < 2:
            return Change()
        compared = self.compared(now)
        found = self.suspects(compared)
        named, recovered = [], []
        for rank, straggler in found.items():
            since = self.suspect_since.setdefault(rank, now)
            if rank not in self.named and now - since >= CONFIRM_S:
                self.named[rank] = replace(straggler, since=since)
                named.append(self.named[rank])
        for rank in [r for r in self.suspect_since if r not in found]:
            del self.suspect_since[rank]
            if rank in self.named:
                recovered.append(self.named.pop(rank))
        return Change(tuple(named), tuple(recovered), self.scores(compared) if scores else {})


def _few(found: dict[int, Straggler], among: int) -> dict[int, Straggler]:
    """The pattern is a few ranks holding up the rest: when half or more look slow, it is not."""
    return found if len(found) <= among // 2 else {}


class WaitDetector(StragglerDetector):
    """From looks at the ranks' stacks: a rank that waits far less than its peers while they wait
    much."""

    sample_type = WaitSample

    def fractions(self, now: float) -> dict[int, float] | None:
        """Each rank's waiting fraction over the window; None until every rank has enough looks."""
        samples = self.window(now)
        out = {}
        for rank in range(self.world_size):
            q = samples.get(rank, ())
            n = sum(s.samples for s in q)
            if n < MIN_SAMPLES:
                return None
            out[rank] = sum(s.waiting for s in q) / n
        return out

    def compared(self, now: float) -> dict[int, tuple[float, float]]:
        """rank -> its waiting fraction and its peers' median (nothing until every rank has enough)."""
        waits = self.fractions(now)
        return _against_peers(waits) if waits is not None else {}

    def scores(self, compared: dict[int, tuple[float, float]]) -> dict[int, float]:
        return {rank: _slowdown(mine, peers) for rank, (mine, peers) in compared.items()}

    def suspects(self, compared: dict[int, tuple[float, float]]) -> dict[int, Straggler]:
        found = {}
        for rank, (mine, peers) in compared.items():
            if peers >= PEERS_WAITING_MIN and mine <= peers * AS_LITTLE_AS:
                found[rank] = WaitStraggler(rank, _slowdown(mine, peers), 0.0, mine, peers)
        return _few(found, len(compared))


def _against_peers(values: dict[int, float]) -> dict[int, tuple[float, float]]:
    """rank -> its value and the median of the other ranks' (nothing with fewer than two ranks)."""
    if len(values) < 2:
        return {}
    return {
        rank: (mine, statistics.median(v for r, v in values.items() if r != rank))
        for rank, mine in values.items()
    }


def _slowdown(mine: float, peers: float) -> float:
    """A rank's time per step outside collectives against its peers', from the fractions of time
    waiting in collectives: both run one step each, the peers' time outside collectives is their
    compute, its own the whole step less its waits."""
    return (1.0 - mine) / max(1.0 - peers, 0.02)


ByPeers = dict[tuple[int, int], dict[int, tuple[float, float]]]  # (stage, place) -> rank -> (mine, peers')


class StepDetector(StragglerDetector):
    """From the ranks' forward step times: a rank whose steps take SLOWER_BY its peers' median or
    more, its peers being the ranks of its stage and place in the other data-parallel replicas
    (`StepSample`). Without data parallelism a rank has no peers and names nobody."""

    sample_type = StepSample

    def means(self, now: float) -> dict[tuple[int, int], dict[int, float]]:
        """(stage, place) -> rank -> mean forward step over the window, for the ranks with MIN_STEPS
        in it."""
        groups: dict[tuple[int, int], dict[int, float]] = {}
        for rank, q in self.window(now).items():
            steps = sum(s.steps for s in q)
            if steps >= MIN_STEPS:
                groups.setdefault((q[-1].stage, q[-1].place), {})[rank] = sum(s.seconds for s in q) / steps
        return groups

    def compared(self, now: float) -> ByPeers:
        """(stage, place) -> rank -> its mean forward step and its peers' median."""
        return {group: _against_peers(means) for group, means in self.means(now).items()}

    def scores(self, compared: ByPeers) -> dict[int, float]:
        return {
            rank: mine / peers
            for group in compared.values()
            for rank, (mine, peers) in group.items()
            if peers
        }

    def suspects(self, compared: ByPeers) -> dict[int, Straggler]:
        found: dict[int, Straggler] = {}
        for (stage, _), against in compared.items():
            here = {
                rank: StepStraggler(rank, mine / peers, 0.0, stage, mine, peers)
                for rank, (mine, peers) in against.items()
                if mine >= SLOWER_BY * peers > 0
            }
            found.update(_few(here, len(against)))
        return found


# which detector takes which sample (driver/supervision/stragglers.py keeps one of each per job)
DETECTORS: dict[type, type[StragglerDetector]] = {d.sample_type: d for d in (WaitDetector, StepDetector)}
