"""What follows a failed attempt (Ray Train's `FailurePolicy` makes the same decision from a typed
failure): the controller (driver/lifecycle/controller.py) only carries it out, so the rule is tested
without a cluster.

The rule is torchrun's, on purpose: every kind of failure (a raise, an exit, a death, a hang, a lost
node, a crash on the way out) counts against --max-restarts alike, as under torch elastic's agent,
where a lost node is a failed rendezvous like any other. What is not a failure does not count: a
grow onto new nodes (torch elastic's restart for nodes waiting) and an eviction of a slow node are
the scaling policy's (core/elastic.py), decided apart. Ray Train v2 also counts failures to start
the worker group apart from training failures; megaray does not, so that --max-restarts means what
it means to a torchrun user."""

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
