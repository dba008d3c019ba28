"""A rank the others wait for, named while the job runs: on the console and in the run directory's
`stragglers.json` (rank, node, how much slower, since when, until when). The decisions are
core/straggler.py's; the samples come through the nodes' forwarders and the output sink (rank/waits.py
for any program, megatron/steptimes.py for the Megatron target; driver/output/relay.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...core.goodput import GoodputTrack
from ...core.straggler import DETECTORS, WINDOW_S, Sample, StragglerDetector
from ...rank.waits import send_every

log = logging.getLogger("megaray")

LOOK_EVERY_S = 2.0


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


class StragglerWatch:
    """Feeds the detectors and says what they decide; `where[rank]` names the rank's node."""

    def __init__(
        self, run_dir: Path, where: list[str], clock: Callable[[], float] = time.monotonic,
        on_scores: Callable[[dict[int, float]], None] | None = None,
        wall_offset: Callable[[], float] = lambda: time.time() - time.monotonic(),
        goodput: GoodputTrack | None = None,
    ):  # fmt: skip
        """`on_scores` is given every rank's straggler score at each look (the job's metrics); without
        it none is computed. The samples' times and `clock` are monotonic (the sink stamps them so,
        driver/output/relay.py), so a step of the wall clock never pauses or rushes a window; what is said
        and written is wall time (`wall_offset` added). `goodput` is told each rank named and
        recovered (core/goodput.py: what the slowness cost)."""
        self.on_scores, self.goodput = on_scores, goodput
        self.path = run_dir / "stragglers.json"
        self.unwritable = False  # said once that the file could not be written
        self.where = where
        self.clock, self.wall_offset = clock, wall_offset
        # three sends of each rank at least (they send less often in a large job)
        self.window_s = max(WINDOW_S, 3 * send_every(len(where)))
        self.detectors: dict[type, StragglerDetector] = {}  # made for the kinds of sample that arrive
        self.found: list[dict[str, Any]] = []  # every finding, in order; a rank's last is its current
        self.slow: dict[int, tuple[float, float]] = {}  # named and not recovered: (since, slowdown), by rank
        self.next_look = 0.0
        self.held = False  # megaray's own work loads the ranks' nodes: nothing is decided meanwhile

    def hold(self, busy: bool) -> None:
        """`busy`: megaray loads the ranks' nodes itself (warm spares importing torch and Megatron
        beside the training, driver/lifecycle/attempt.py), so the ranks' timings are not their own and
        no look is made. Once it is over the next look waits for a window of samples taken after it,
        and suspicions from before are dropped (a rank named before stays named until its evidence
        says otherwise). On 2 CPU cores the spares' imports got two ranks named 1.5x slow for 6-7 s."""
        if busy:
            self.held = True
        elif self.held:
            self.held = False
            self.next_look = self.clock() + self.window_s
            for detector in self.detectors.values():
                detector.forget_suspicions()

    def sample(self, sample: Sample) -> None:
        kind = type(sample)
        if kind not in self.detectors:
            self.detectors[kind] = DETECTORS[kind](len(self.where), self.window_s)
        self.detectors[kind].add(sample)

    def look(self) -> None:
        now = self.clock()
        if self.held or now < self.next_look:
            return
        self.next_look = now + LOOK_EVERY_S
        scores = self.on_scores is not None
        changes = [detector.look(now, scores) for detector in self.detectors.values()]
        if self.on_scores is not None:
            self.on_scores({r: v for change in changes for r, v in change.scores.items()})
        for s in (s for change in changes for s in change.named):
            where = self.where[s.rank]
            since = s.since + self.wall_offset()
            log.warning("rank %d on %s is slow: %s, since %s", s.rank, where, s.describe(), _clock(since))
            record = {"rank": s.rank, "node": where, "slowdown": round(s.slowdown, 2), **s.figures()}
            self.found.append({**record, "since": since, "until": None})
            self.slow[s.rank] = (s.since, s.slowdown)
            if self.goodput is not None:
                self.goodput.straggler(s.rank, since, s.slowdown)
        for s in (s for change in changes for s in change.recovered):
            until = now + self.wall_offset()
            log.info("rank %d on %s is no longer slow (since %s)", s.rank, self.where[s.rank], _clock(until))
            next(r for r in reversed(self.found) if r["rank"] == s.rank)["until"] = until
            self.slow.pop(s.rank, None)
            if self.goodput is not None:
                self.goodput.recovered(s.rank, until)
        if any(change.named or change.recovered for change in changes):
            try:
                self.path.write_text(json.dumps(self.found, indent=1) + "\n")
            except (
                OSError
            ) as e:  # a full disk, the run directory gone: the run goes on (driver/output/rundir.py)
                if not self.unwritable:
                    self.unwritable = True
                    log.warning("%s could not be written (%s)", self.path, e.strerror or e)
