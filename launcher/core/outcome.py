"""What a rank's run returns to the driver, where a launch stands, and how it ended: typed, never
dicts whose keys and string values each file must agree on (torch elastic's `RunResult`,
`ProcessFailure` and `WorkerState` do the same)."""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from .errors import FailureKind, Interrupted, MegarayError, RankFailedError
from .topology import RankInfo


@dataclass(frozen=True)
class RankOutcome:
    """The result of a call on a rank (its program, or a rank group's method): what it returned, or
    how it failed, told by the rank itself. A process that died tells nothing: the driver makes its
    RankFailure from what Ray says."""

    ok: bool
    value: Any = None
    kind: FailureKind | None = None  # set when not ok
    summary: str = ""
    traceback: str = ""
    exit_code: int | None = None
    at: float = 0.0  # when it failed (wall clock), to pick the root cause across ranks
    error_file: str = ""  # where the program recorded its error (torch elastic's @record), if it did
    lingering: tuple[str, ...] = ()  # what would still run if the process exited now (ok only)


class LaunchState(StrEnum):
    """Where a launch stands: one value, stepped through by the driver's controller
    (driver/controller.py). An attempt goes placing -> starting -> running -> finishing; a failure
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


@dataclass(frozen=True)
class RunOutcome:
    status: LaunchState
    exit_code: int
    root_cause: str | None = None
    failures: list = field(default_factory=list)  # RankFailures, root cause first

    def __post_init__(self):
        if not self.status.ended:
            raise ValueError(f"a launch ends succeeded, failed, interrupted or error, not {self.status}")

    def summary(self) -> dict[str, Any]:
        """The fields summary.json has always had (failures only when there are some)."""
        out: dict[str, Any] = {"status": self.status, "exit_code": self.exit_code}
        out["root_cause"] = self.root_cause
        if self.failures:
            out["failures"] = self.failures
        return out


def run_outcome(error: BaseException | None) -> RunOutcome:
    """How a launch that ended with `error` (None: it succeeded) ended, with the exit code the command
    gives: 1 for a failed rank, 2 for bad input or resources, 128+N for signal N, as a shell does."""
    match error:
        case None:
            return RunOutcome(LaunchState.SUCCEEDED, 0)
        case RankFailedError():
            return RunOutcome(LaunchState.FAILED, error.exit_code, str(error), error.failures)
        case Interrupted():
            return RunOutcome(LaunchState.INTERRUPTED, error.exit_code, str(error))
        case KeyboardInterrupt():  # before megaray's own handler was installed
            return RunOutcome(LaunchState.INTERRUPTED, 128 + signal.SIGINT, "interrupted by SIGINT")
        case MegarayError():
            return RunOutcome(LaunchState.ERROR, error.exit_code, str(error))
        case _:
            return RunOutcome(LaunchState.ERROR, 1, f"{type(error).__name__}: {error}")


class RestartKind(StrEnum):
    FAILURE = "failure"  # a rank failed: counted against --max-restarts
    GROW = "grow"  # --nodes MIN:MAX, below MAX: relaunched on more nodes (not counted)


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


@dataclass(frozen=True)
class LaunchResult:
    """What `launch()` returns once every rank finished: where they ran and what each returned."""

    job_name: str
    world_size: int
    master_addr: str
    master_port: int
    ranks: tuple[RankInfo, ...]
    returns: tuple[Any, ...]  # what each rank's target returned, by rank
    timings: dict[str, float] = field(default_factory=dict)
