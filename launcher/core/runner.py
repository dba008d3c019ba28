"""What each kind of target does, on a rank and in the driver, as one object per kind (torchtitan's
`TrainSpec` does the same for its models). The registry that maps a kind to its runner is the
driver's (driver/lifecycle/registry.py): plain programs register theirs from rank/programs.py, the Megatron
targets from megatron/runners.py, so that neither rank/ nor the driver knows Megatron's rules.

A runner is sent to each rank with its target, so it must pickle by reference: a module-level class
with no state. What it imports heavy (torch, Megatron) it imports inside its methods: on a rank they
run after the rank's env is set, and in the driver only for the targets that need them.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from .layout import ParallelDims
from .spec import LaunchSpec
from .target import Target

BASE_IMPORTS = ("torch", "torch.distributed")


class Answer(StrEnum):
    """What a preflight worked out elsewhere came back as (megatron/preflight_process.py): defined here,
    not in that module, which its process runs as `__main__`, so that the pickled answer reads back
    as this class in the driver."""

    PLAN = "plan"  # the plan: the launch goes on
    REFUSED = "refused"  # a UsageError: the launch ends with its one line, exit 2
    CRASHED = "crashed"  # the preflight itself failed: the ranks build the config themselves


class Verdict[P]:
    """The preflight's answer: a plan the driver's other hooks read (None: nothing was checked), or a
    refusal (UsageError). This one is known at once; a preflight that takes seconds (Megatron-Bridge's
    import and config) answers from a process of its own (megatron/preflight_process.py) while the
    driver connects and the ranks start, so nothing waits for it before training starts."""

    in_background = False  # still being worked out somewhere else: the ranks may import meanwhile

    def __init__(self, plan: P | None = None):
        self._plan = plan
        self.refusal: BaseException | None = None  # the error `ready()` raised, once it has

    def ready(self) -> bool:
        """Whether the answer is in; raises the refusal the first time it is asked after it came."""
        return True

    def result(self, wait: Callable[[], None] = lambda: None, poll_s: float = 0.05) -> P | None:
        """The plan, once in; `wait` runs between polls (the driver's stop check, which may raise)."""
        while not self.ready():
            wait()
            time.sleep(poll_s)
        return self._plan

    def ask(self, process: Any, after: Any = None) -> None:
        """Let `process` (a rank actor with the target's stack imported: a warm pool's, or a rank's
        once the call `after` is done) work the answer out, when that is quicker than waiting."""

    def cancel(self) -> None:
        """No answer is wanted any more (the launch ended first): stop working it out."""


class TargetRunner[P]:
    """`P` is the plan its preflight makes (None for a plain program's, which makes none). The defaults
    are a plain program's: nothing checked ahead, nothing changed on a relaunch (it
    resumes itself, as under torchrun), torch imported ahead by a warm spare."""

    relays_output = (
        True  # megaray collects its ranks' output (driver/output/relay.py), not Ray's log streaming
    )
    # straggler detection looks at the rank's stack (rank/waits.py); a target that times its own steps
    # (the Megatron targets: megatron/steptimes.py) needs no looks
    looks_at_waits = True
    # with --nodes MIN:MAX, a target that writes checkpoints (the Megatron targets) grows at the next
    # one written once the cluster has room; a plain program at its next failure or --grow-after
    grows_at_checkpoint = False

    # -- on a rank ----------------------------------------------------------------------------------
    def run(self, target: Target, cwd: str) -> Any:
        """Run the target to completion in this process, in `cwd` as a shell started there would."""
        if os.path.isdir(cwd):
            os.chdir(cwd)
            os.environ["PWD"] = cwd  # as a shell sets it: the node's `ray start` folder otherwise
        return self.main(target, cwd)

    def main(self, target: Target, cwd: str) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not run on a rank")

    def warm_imports(self, target: Target) -> tuple[str, ...]:
        """What a warm spare imports before its rank needs it: `module`, or `module:function` to call.
        Only the launcher's own stack: a user's program is never run ahead of time (its import-time
        code would run with the previous attempt's env)."""
        return BASE_IMPORTS

    def prepare(self, target: Target) -> None:
        """On a rank that has imported its stack, before its program's go (the preflight's verdict, or
        a spare's rank failing): what the program does first that no go changes, done ahead. A plain
        program: nothing (its code never runs ahead)."""

    def own_files(self) -> tuple[str, ...]:
        """The runner's source files: their frames lead no traceback a user reads."""
        return tuple({inspect.getfile(c) for c in type(self).__mro__ if issubclass(c, TargetRunner)})

    # -- in the driver ------------------------------------------------------------------------------
    def describe(self, target: Target) -> str:
        """The target in one line, for the console and `megaray status`: what it is, then its args."""
        return " ".join([self.shown_as(target), *target.args])

    def shown_as(self, target: Target) -> str:
        """What the target is, in `describe`: a plain program's name."""
        return target.name

    def check_locally(self, target: Target, cwd: str) -> None:
        """Bad input the driver can find before anything is placed (UsageError): `cwd` is the
        launch's working folder, as the ranks will read it."""

    def check_submitted(self, target: Target, local_dir: str | None, uploads: bool) -> None:
        """`megaray submit`: what can be told of the target from the folder it uploads (`local_dir`,
        when it is local; `uploads`: whether a working folder is uploaded at all)."""

    def preflight(self, spec: LaunchSpec) -> Verdict[P]:
        """What can be checked before the program starts: its verdict, now or on its way."""
        return Verdict()

    def first_target(self, spec: LaunchSpec, plan: P | None) -> Target:
        """The target of the first attempt (the spec's, or one adjusted to megaray's own settings)."""
        return spec.target

    def memory_problem(self, spec: LaunchSpec, plan: P | None, gpu_gib: float) -> str | None:
        """Why the program would not fit the placed GPUs (the smallest has `gpu_gib`), or None."""
        return None

    def resume_target(self, target: Target, plan: P | None) -> Target:
        """The target of a relaunch after a failure."""
        return target

    def size_problem(self, spec: LaunchSpec, plan: P | None, nodes: int) -> str | None:
        """Why the target cannot run on `nodes` nodes (`--nodes MIN:MAX`, core/elastic.py), or None: a
        plain program runs on any count, as under torchrun's elastic launch."""
        return None

    def parallel_dims(self, spec: LaunchSpec, plan: P | None) -> ParallelDims | None:
        """The TP, PP and CP sizes of `spec`'s world, for the ranks' coordinates in the metrics
        (core/metrics.py); None where the target does not know them (a plain program)."""
        return None


class RankGroupRunner(TargetRunner[None]):
    """A rank group's functions are called from the driver's process (driver/gang/group.py), and print
    through Ray's own log streaming: the group has no output sink."""

    relays_output = False

    def shown_as(self, target: Target) -> str:
        return "rank group (functions called from this process)"
