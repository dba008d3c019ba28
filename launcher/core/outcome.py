"""What a rank's run returns to the driver, how a launch ended and what it returns: typed, never
dicts whose keys and string values each file must agree on (torch elastic's `RunResult` and
`ProcessFailure` do the same). Where a launch stands meanwhile is core/lifecycle.py's."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from .errors import FailureKind, Interrupted, MegarayError, RankFailedError
from .lifecycle import LaunchState
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
    after_stop: bool = False  # the driver's stop had reached the rank first: maybe the stop's doing
    error_file: str = ""  # where the program recorded its error (torch elastic's @record), if it did
    lingering: tuple[str, ...] = ()  # what would still run if the process exited now (ok only)


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
