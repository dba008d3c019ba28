"""What one look at a running attempt found, typed: the controller decides from it
(driver/lifecycle/controller.py `Running`) as Ray Train v2's controller decides from its worker group's
`WorkerGroupPollStatus`, instead of the watch raising out of its callbacks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .elastic import Evict, GrowTo
from .errors import RankFailedError


@dataclass(frozen=True)
class StillRunning:
    """No rank has ended yet, or those that did returned and the others run on."""


@dataclass(frozen=True)
class AllReturned:
    """Every rank's program returned: their values, by rank."""

    returns: tuple[Any, ...]


@dataclass(frozen=True)
class RanksFailed:
    """A rank failed (raised, died, hung, or its node was lost): the ranks that did, root cause first."""

    failure: RankFailedError


PollStatus = StillRunning | AllReturned | RanksFailed | GrowTo | Evict
