"""The controller's vocabulary (driver/lifecycle/controller.py): where a launch stands (`LaunchState`, one
value, as torch elastic's `WorkerState`), a relaunch as summary.json records it (`Restart`), and what
is told of each step to those who watch it (`LaunchObserver`: the progress view, the job's metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from .errors import RankFailedError


class LaunchState(StrEnum):
    """Where a launch stands: one value, stepped through by the driver's controller
    (driver/lifecycle/controller.py). An attempt goes placing -> starting -> running -> finishing; a failure
    while restarts are left goes through restarting back to placing. The last four end a launch; their
    values are summary.json's `status`."""

    PLACING = "placing"  # a placement group per node, or warm spares / the warm pool taken over
    STARTING = "starting"  # an actor per rank, the rendezvous port, every rank's env
    RUNNING = "running"  # the program runs on every rank, watched for failures and hangs
    FINISHING = "finishing"  # every rank returned; their processes exit as Python's do
    RESTARTING = "restarting"  # a rank failed and the failure policy relaunches the group
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a rank failed and no restart is left
    INTERRUPTED = "interrupted"  # Ctrl-C or SIGTERM
    ERROR = "error"  # bad input, resources, the cluster, or megaray itself

    @property
    def ended(self) -> bool:
        return self in _ENDED


_ENDED = frozenset({LaunchState.SUCCEEDED, LaunchState.FAILED, LaunchState.INTERRUPTED, LaunchState.ERROR})


class RestartKind(StrEnum):
    FAILURE = "failure"  # a rank failed: counted against --max-restarts
    GROW = "grow"  # --nodes MIN:MAX, below MAX: relaunched on more nodes (not counted)
    EVICT = "evict"  # --evict-stragglers: relaunched without a slow node (not counted)


@dataclass
class Restart:
    """A relaunch, as summary.json's `restarts` lists it."""

    attempt: int
    cause: str
    at: float
    warm_spares: bool | None = None  # whether the relaunch took over the failed attempt's spares
    kind: RestartKind = RestartKind.FAILURE

    def record(self) -> dict[str, Any]:
        return asdict(self)


class LaunchObserver:
    """Told what the controller does (the progress view, the job's metrics); the defaults ignore it."""

    def on_state(self, state: LaunchState) -> None:
        pass

    def on_failure(self, failure: RankFailedError) -> None:
        """An attempt failed (whatever the policy decides)."""

    def on_restart(self, restart: Restart) -> None:
        """A relaunch was decided (a failure's or a grow's)."""
