"""A rank the others wait for, named while the job runs: on the console and in the run directory's
`stragglers.json` (rank, node, how much slower, since when, until when). The decision is
core/straggler.py's; the samples come through the output sink (rank/waits.py, driver/relay.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.straggler import WINDOW_S, StragglerDetector, WaitSample
from ..rank.waits import send_every

log = logging.getLogger("megaray")

LOOK_EVERY_S = 2.0


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


class StragglerWatch:
    """Feeds the detector and says what it decides; `where[rank]` names the rank's node."""

    def __init__(self, run_dir: Path, where: list[str], clock: Callable[[], float] = time.time):
        self.path = run_dir / "stragglers.json"
        self.where = where
        self.clock = clock
        # three sends of each rank at least (they send less often in a large job)
        self.detector = StragglerDetector(len(where), max(WINDOW_S, 3 * send_every(len(where))))
        self.found: list[dict[str, Any]] = []  # every finding, in order; a rank's last is its current
        self.next_look = 0.0

    def sample(self, rank: int, at: float, samples: int, waiting: int) -> None:
        self.detector.add(WaitSample(rank, at, samples, waiting))

    def look(self) -> None:
        now = self.clock()
        if now < self.next_look:
            return
        self.next_look = now + LOOK_EVERY_S
        change = self.detector.look(now)
        for s in change.named:
            log.warning(
                "rank %d on %s is slow: %s, since %s",
                s.rank,
                self.where[s.rank],
                s.describe(),
                _clock(s.since),
            )
            record = {
                "rank": s.rank, "node": self.where[s.rank], "slowdown": round(s.slowdown, 2),
                "waiting": round(s.waiting, 3), "peers_waiting": round(s.peers_waiting, 3),
                "since": s.since, "until": None,
            }  # fmt: skip
            self.found.append(record)
        for s in change.recovered:
            log.info("rank %d on %s is no longer slow (since %s)", s.rank, self.where[s.rank], _clock(now))
            next(r for r in reversed(self.found) if r["rank"] == s.rank)["until"] = now
        if change.named or change.recovered:
            self.path.write_text(json.dumps(self.found, indent=1) + "\n")
