"""Goodput: of a launch's wall time, how much trained the model, and where the rest went (issue #47;
Google's ml-goodput-measurement splits a job's time the same way, from the job's own records).

Worked out from what the driver already sees, without processes: when the launch began and ended,
each relaunch, and the iterations the ranks reported (Megatron's log lines, or `launcher.report()`),
each with its time. The parts add up to the wall time:

- training: from an attempt's first reported iteration to its last, less what was recomputed;
- start-up: from the launch's start to the first attempt's first iteration (placement, the
  processes' start, imports, the model's build, the first iteration itself);
- restarts: from an attempt's last iteration to the next one's first (finding the failure, the
  teardown, the relaunch and its start-up), for a failure or a grow alike;
- recomputed: iterations an attempt made again after resuming from a checkpoint older than what an
  earlier attempt had reached, the first of them included (at that attempt's own time per
  iteration);
- checkpoint: saving a checkpoint (taken from the training, or from the end where the last one is
  saved after the last iteration) and loading one (taken from the start-up or the restart), from
  the lines that start and end each (Megatron-Bridge's, the dry run's; a plain program's
  `launcher.checkpointing`); a save whose start was not said is not seen (counted where it fell);
- straggler: of the training while a rank was named slow (driver/supervision/stragglers.py), the
  share its slowness cost (`1 - 1/slowdown` of each second: the job went at its pace);
- idle: after the last iteration, once the launch ended (the processes' exit, the teardown).

The measured save cost and the failures give the checkpoint interval that loses least (`advice`:
Young and Daly's √(2 x save cost x mean time between failures)).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from enum import StrEnum

from .progress import Phase, duration

# a save quicker than this is not weighed: the lines are timed as they reach the sink, batched by
# the nodes' forwarders (a fraction of a second), and a save that costs nothing has no best interval
MIN_SAVE_S = 1.0
NO_CHECKPOINTS = (
    "no checkpoint save or load was said (Megatron-Bridge's lines, the dry run's, or a plain program's "
    "`launcher.checkpointing`): any is counted where it fell, most often as training"
)


class Cause(StrEnum):
    TRAINING = "training"
    STARTUP = "start-up"
    RESTARTS = "restarts"
    RECOMPUTED = "recomputed"
    CHECKPOINT = "checkpoint"
    STRAGGLER = "straggler"
    IDLE = "idle"


@dataclass(frozen=True)
class Reported:
    """An iteration a rank said it finished, and when (wall clock)."""

    at: float
    iteration: int


@dataclass
class AttemptTrack:
    """One attempt's first and last reported iterations (each report higher than the one before),
    and the first that reached what earlier attempts had (`caught_up`: the end of the iterations
    made again): all the ledger needs, whatever the run's length."""

    first: Reported | None = None
    last: Reported | None = None
    caught_up: Reported | None = None


@dataclass(frozen=True)
class Stall:
    """A checkpoint saved (`save`) or loaded, from `start` to `end` (wall clock)."""

    start: float
    end: float
    save: bool
    attempt: int  # which attempt (0: the first)


@dataclass
class Slowed:
    """A rank named slow (driver/supervision/stragglers.py) from `since` until `until` (None: still),
    `slowdown` times its peers' time per step."""

    since: float
    slowdown: float
    until: float | None = None


class GoodputTrack:
    """Fed as the launch runs: each relaunch and each new iteration reported (the progress view,
    driver/output/progress_view.py), each straggler named and recovered (its watch)."""

    def __init__(self):
        self.attempts: list[AttemptTrack] = [AttemptTrack()]
        self.slowed: list[Slowed] = []
        self.open: dict[int, Slowed] = {}  # by rank: named and not recovered
        self.stalls: list[Stall] = []  # every checkpoint saved or loaded, start to end
        # a save (True) or load (False) said started and not ended: since when, by which ranks
        self.started: dict[bool, tuple[float, set[int]]] = {}
        self.failures = 0  # relaunches after a failure (not a grow's or an eviction's)
        self.reached = 0  # the highest iteration the attempts before the current one reported

    def checkpoint(self, phase: Phase, at: float, rank: int = 0) -> None:
        """Rank `rank` said a checkpoint is being saved or loaded, or is: from the first rank's start
        to the end of the last that started (Megatron-Bridge says it on rank 0 only; a plain
        program's every rank may, each saving its part)."""
        save = phase in (Phase.SAVING, Phase.SAVED)
        if phase in (Phase.SAVING, Phase.LOADING):
            self.started.setdefault(save, (at, set()))[1].add(rank)
        elif (began := self.started.get(save)) is not None and rank in began[1]:
            began[1].discard(rank)
            if not began[1]:
                del self.started[save]
                self.stalls.append(Stall(began[0], max(at, began[0]), save, len(self.attempts) - 1))

    @property
    def first_at(self) -> float | None:
        """When the launch's first iteration was reported (its time to first step)."""
        return next((a.first.at for a in self.attempts if a.first is not None), None)

    def relaunched(self) -> None:
        last = self.attempts[-1].last
        for rank, slowed in list(self.open.items()):  # ended with its attempt
            self.recovered(rank, last.at if last is not None else slowed.since)
        self.reached = max(self.reached, last.iteration if last is not None else 0)
        self.attempts.append(AttemptTrack())
        self.started.clear()  # a save or load the failure cut short: never ended

    def straggler(self, rank: int, since: float, slowdown: float) -> None:
        self.open[rank] = Slowed(since, slowdown)
        self.slowed.append(self.open[rank])

    def recovered(self, rank: int, until: float) -> None:
        if (slowed := self.open.pop(rank, None)) is not None:
            slowed.until = max(until, slowed.since)

    def iteration(self, at: float, iteration: int) -> None:
        attempt = self.attempts[-1]
        attempt.last = Reported(at, iteration)
        if attempt.first is None:
            attempt.first = attempt.last
        if attempt.caught_up is None and iteration >= self.reached:
            attempt.caught_up = attempt.last


@dataclass(frozen=True)
class Ledger:
    """Seconds by cause, adding up to `wall_s`; `restarts` relaunches among them."""

    wall_s: float
    seconds: dict[Cause, float]
    restarts: int
    not_seen: str = ""  # what the ledger could not tell apart, and where it counted it

    def __post_init__(self):
        total = sum(self.seconds.values())
        if abs(total - self.wall_s) > 1e-6 * max(1.0, self.wall_s):
            raise ValueError(
                f"the ledger's parts add up to {total:.3f} s, not the wall time {self.wall_s:.3f} s"
            )

    @property
    def ratio(self) -> float:
        return self.seconds[Cause.TRAINING] / self.wall_s if self.wall_s > 0 else 0.0

    def record(self) -> dict[str, object]:
        """For summary.json."""
        return {
            "ratio": round(self.ratio, 4),
            "wall_s": round(self.wall_s, 3),
            "seconds": {cause.value: round(s, 3) for cause, s in self.seconds.items()},
            **({"not_seen": self.not_seen} if self.not_seen else {}),
        }

    def describe(self) -> str:
        """The run's one line: `goodput 87.3% of 5m02s: training 4m24s, start-up 21s, ...`."""
        parts = [
            f"{cause.value} {duration(s, tenths=True)}"
            + (f" ({self.restarts})" if cause is Cause.RESTARTS else "")
            for cause, s in self.seconds.items()
            if s >= 0.05 or cause is Cause.TRAINING
        ]
        wall = duration(self.wall_s, tenths=True)
        return f"goodput {100 * self.ratio:.1f}% of {wall}: {', '.join(parts)}"


def ledger(track: GoodputTrack, began: float, ended: float, live: bool = False) -> Ledger | None:
    """The ledger of a launch from `began` to `ended` (wall clock); None where no iteration was
    reported (a plain program that never calls `report()`: nothing to count). The time after the last
    report is the end's (idle) once the launch ended; `live` (while it runs), the iteration in flight
    (training). Either way, after a relaunch that has not reported yet it is the restart's."""
    attempts = [
        (a.first, a.last, a.caught_up) for a in track.attempts if a.first is not None and a.last is not None
    ]
    if not attempts:
        return None
    wall = max(0.0, ended - began)
    seconds = dict.fromkeys(Cause, 0.0)
    reached = 0  # the highest iteration any earlier attempt reported
    previous_last: float | None = None
    for first, last, caught_up in attempts:
        gap = max(0.0, first.at - (began if previous_last is None else previous_last))
        span = max(0.0, last.at - first.at)
        made = last.iteration - first.iteration
        again = max(0, min(last.iteration, reached) - first.iteration)
        # an iteration made again: its time from the first to catching up (or the attempt's end),
        # less the checkpoints saved meanwhile (their own cause, below)
        upto = caught_up if caught_up is not None and caught_up.iteration > first.iteration else last
        timed = upto.iteration - first.iteration
        each = (
            max(0.0, upto.at - first.at - _overlap(track.stalls, first.at, upto.at)) / timed
            if timed > 0
            else 0.0
        )
        recomputed = each * again
        if previous_last is not None and first.iteration <= reached and made > 0:
            # the first iteration reported, itself made again, ended the gap: its time is recomputed
            own = min(gap, each)
            gap, recomputed = gap - own, recomputed + own
            span += own
        seconds[Cause.STARTUP if previous_last is None else Cause.RESTARTS] += gap
        seconds[Cause.RECOMPUTED] += recomputed
        seconds[Cause.TRAINING] += span - recomputed
        reached = max(reached, last.iteration)
        previous_last = last.at
    rest = wall - sum(seconds.values())
    if rest < 0:  # a rank's clock ahead of the driver's (another machine's): off the training
        seconds[Cause.TRAINING] = max(0.0, seconds[Cause.TRAINING] + rest)
        rest = 0.0
    reporting = track.attempts[-1].first is not None
    seconds[Cause.RESTARTS if not reporting else Cause.TRAINING if live else Cause.IDLE] += rest
    windows = [(first.at, last.at) for first, last, _ in attempts]
    if live and reporting:  # the iteration in flight
        windows[-1] = (windows[-1][0], max(windows[-1][1], ended))
    _take_stalls(seconds, track.stalls, windows, (began, ended), Cause.IDLE if reporting else Cause.RESTARTS)
    slowed = min(seconds[Cause.TRAINING], _slowed_s(track.slowed, windows, ended, track.stalls))
    seconds[Cause.TRAINING] -= slowed
    seconds[Cause.STRAGGLER] += slowed
    unseen = "" if track.stalls else NO_CHECKPOINTS
    return Ledger(max(wall, sum(seconds.values())), seconds, len(track.attempts) - 1, unseen)


def _overlap(stalls: list[Stall], start: float, end: float) -> float:
    return sum(max(0.0, min(end, s.end) - max(start, s.start)) for s in stalls)


def _take_stalls(
    seconds: dict[Cause, float], stalls: list[Stall], windows: list[tuple[float, float]],
    launch: tuple[float, float], after: Cause,
) -> None:  # fmt: skip
    """Checkpoints saved and loaded, out of where they fell: the training windows, the start-up
    (before the first), a restart (between two), or the end (`after`: idle, or a restart when the
    last attempt never reported)."""
    for stall in stalls:
        start, end = max(stall.start, launch[0]), min(stall.end, launch[1])
        if end <= start:
            continue
        inside = sum(_overlap([stall], a, b) for a, b in windows)
        where = (
            Cause.STARTUP if end <= windows[0][0] else after if start >= windows[-1][1] else Cause.RESTARTS
        )
        for cause, amount in ((Cause.TRAINING, inside), (where, end - start - inside)):
            moved = min(max(0.0, amount), seconds[cause])
            seconds[cause] -= moved
            seconds[Cause.CHECKPOINT] += moved


@dataclass(frozen=True)
class Advice:
    """Young and Daly's checkpoint interval, from what the run measured: a save's cost and the time
    between failures (the interval that loses least to saving and to recomputing after a failure)."""

    every_s: float  # the run's mean time from a save's start to the next's
    save_s: float  # a save's mean cost
    between_failures_s: float
    iteration_s: float | None  # the training's time per iteration, where reported

    @property
    def best_s(self) -> float:
        return math.sqrt(2.0 * self.save_s * self.between_failures_s)

    @property
    def far(self) -> bool:
        """Worth saying: the run's interval over twice the best, or under half of it."""
        return not 0.5 * self.best_s <= self.every_s <= 2.0 * self.best_s

    def describe(self) -> str:
        iterations = f" (about {self.best_s / self.iteration_s:.0f} iterations)" if self.iteration_s else ""
        every, save = duration(self.every_s, tenths=True), duration(self.save_s, tenths=True)
        return (
            f"checkpoints every {every}, each {save} to save, with a failure every "
            f"{duration(self.between_failures_s)}: saving about every {duration(self.best_s)}{iterations} "
            "would lose least (Young-Daly: the square root of 2 x save cost x time between failures)"
        )


def advice(track: GoodputTrack, wall_s: float) -> Advice | None:
    """Young-Daly's interval for a run of `wall_s` seconds, where it had a failure and two saves in
    one attempt (an interval measured) that took MIN_SAVE_S or more; None otherwise."""
    saves = [s for s in track.stalls if s.save]
    gaps = [b.start - a.start for a, b in itertools.pairwise(saves) if a.attempt == b.attempt]
    cost = sum(s.end - s.start for s in saves) / len(saves) if saves else 0.0
    if track.failures < 1 or not gaps or cost < MIN_SAVE_S:
        return None
    made = [
        (a.last.iteration - a.first.iteration, a.last.at - a.first.at)
        for a in track.attempts
        if a.first and a.last
    ]
    iterations, spent = sum(m for m, _ in made), sum(s for _, s in made)
    return Advice(
        sum(gaps) / len(gaps), cost, wall_s / track.failures,
        spent / iterations if iterations > 0 else None,
    )  # fmt: skip


def _slowed_s(
    slowed: list[Slowed], windows: list[tuple[float, float]], ended: float, stalls: list[Stall]
) -> float:
    """What the named stragglers cost the training: while one was slow, the job went at its pace, not
    its peers' (one rank `slowdown` times slower makes every step that much longer, its peers waiting
    in the collectives), so of each such second `1 - 1/slowdown` was lost; not of a checkpoint's
    seconds meanwhile (their own cause)."""
    lost = 0.0
    for s in slowed:
        until = ended if s.until is None else s.until
        spans = [(max(s.since, a), min(until, b)) for a, b in windows]
        overlap = sum(max(0.0, hi - lo - _overlap(stalls, lo, hi)) for lo, hi in spans if hi > lo)
        lost += slowed_cost(overlap, s.slowdown)
    return lost


def slowed_cost(seconds: float, slowdown: float) -> float:
    """What `seconds` of training cost while one rank was `slowdown` times slower than its peers: the
    job went at its pace, so `1 - 1/slowdown` of each second was lost."""
    return seconds * max(0.0, 1.0 - 1.0 / slowdown) if slowdown > 0 else 0.0
