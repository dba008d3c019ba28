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
- straggler: of the training while a rank was named slow (driver/supervision/stragglers.py), the
  share its slowness cost (`1 - 1/slowdown` of each second: the job went at its pace);
- idle: after the last iteration, once the launch ended (the processes' exit, the teardown).

Not seen yet, counted as training: checkpoint saves (their time is inside the iterations' times).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from .progress import duration


class Cause(StrEnum):
    TRAINING = "training"
    STARTUP = "start-up"
    RESTARTS = "restarts"
    RECOMPUTED = "recomputed"
    STRAGGLER = "straggler"
    IDLE = "idle"


@dataclass(frozen=True)
class Reported:
    """An iteration a rank said it finished, and when (wall clock)."""

    at: float
    iteration: int


@dataclass
class AttemptTrack:
    """One attempt's first and last reported iterations (each report higher than the one before):
    all the ledger needs, whatever the run's length."""

    first: Reported | None = None
    last: Reported | None = None


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

    @property
    def first_at(self) -> float | None:
        """When the launch's first iteration was reported (its time to first step)."""
        return next((a.first.at for a in self.attempts if a.first is not None), None)

    def relaunched(self) -> None:
        last = self.attempts[-1].last
        for rank, slowed in list(self.open.items()):  # ended with its attempt
            self.recovered(rank, last.at if last is not None else slowed.since)
        self.attempts.append(AttemptTrack())

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


@dataclass(frozen=True)
class Ledger:
    """Seconds by cause, adding up to `wall_s`; `restarts` relaunches among them."""

    wall_s: float
    seconds: dict[Cause, float]
    restarts: int

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
            "not_seen": "checkpoint saves are counted as training",
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
    attempts = [(a.first, a.last) for a in track.attempts if a.first is not None and a.last is not None]
    if not attempts:
        return None
    wall = max(0.0, ended - began)
    seconds = dict.fromkeys(Cause, 0.0)
    reached = 0  # the highest iteration any earlier attempt reported
    previous_last: float | None = None
    for first, last in attempts:
        gap = max(0.0, first.at - (began if previous_last is None else previous_last))
        span = max(0.0, last.at - first.at)
        made = last.iteration - first.iteration
        again = max(0, min(last.iteration, reached) - first.iteration)
        recomputed = span * again / made if made > 0 else 0.0
        if previous_last is not None and first.iteration <= reached and made > 0:
            # the first iteration reported, itself made again, ended the gap: its time is recomputed
            own = min(gap, span / made)
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
    windows = [(first.at, last.at) for first, last in attempts]
    if live and reporting:  # the iteration in flight
        windows[-1] = (windows[-1][0], max(windows[-1][1], ended))
    slowed = min(seconds[Cause.TRAINING], _slowed_s(track.slowed, windows, ended))
    seconds[Cause.TRAINING] -= slowed
    seconds[Cause.STRAGGLER] += slowed
    return Ledger(max(wall, sum(seconds.values())), seconds, restarts=len(track.attempts) - 1)


def _slowed_s(slowed: list[Slowed], windows: list[tuple[float, float]], ended: float) -> float:
    """What the named stragglers cost the training: while one was slow, the job went at its pace, not
    its peers' (one rank `slowdown` times slower makes every step that much longer, its peers waiting
    in the collectives), so of each such second `1 - 1/slowdown` was lost."""
    lost = 0.0
    for s in slowed:
        until = ended if s.until is None else s.until
        overlap = sum(max(0.0, min(until, b) - max(s.since, a)) for a, b in windows)
        lost += overlap * max(0.0, 1.0 - 1.0 / s.slowdown) if s.slowdown > 0 else 0.0
    return lost
