"""What follows a failed attempt, decided from the failure alone (Ray Train's `FailurePolicy`
makes the same decision from a typed failure): the controller (driver/lifecycle/controller.py) only carries
it out, so the rule is tested without a cluster."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from .errors import RankFailedError


class FailureDecision(StrEnum):
    RESTART = "restart"  # relaunch every rank (on warm spares when they are ready)
    FAIL = "fail"  # end the launch with this failure


@dataclass(frozen=True)
class FailurePolicy:
    """torchrun's --max-restarts: any failure (a rank raised, exited non-zero, died, hung, or its
    process crashed on its way out) relaunches the whole group, as long as restarts are left."""

    max_restarts: int = 0

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}")

    def decide(self, failure: RankFailedError, restarts_done: int) -> FailureDecision:
        if restarts_done >= self.max_restarts:
            return FailureDecision.FAIL
        return FailureDecision.RESTART
