"""What a rank's run returns to the driver, and how a launch ended: typed, never dicts whose keys and
string values each file must agree on (torch elastic's `RunResult` and `ProcessFailure` do the same)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .errors import FailureKind


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


class RunStatus(StrEnum):
    """How a launch ended, in its run directory's summary.json."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a rank failed
    INTERRUPTED = "interrupted"  # Ctrl-C or SIGTERM
    ERROR = "error"  # bad input, resources, the cluster, or megaray itself


@dataclass(frozen=True)
class RunOutcome:
    status: RunStatus
    exit_code: int
    root_cause: str | None = None
    failures: list = field(default_factory=list)  # RankFailures, root cause first

    def summary(self) -> dict[str, Any]:
        """The fields summary.json has always had (failures only when there are some)."""
        out: dict[str, Any] = {"status": self.status, "exit_code": self.exit_code}
        out["root_cause"] = self.root_cause
        if self.failures:
            out["failures"] = self.failures
        return out
