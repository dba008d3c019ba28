"""The registry of targets: each kind of target and the runner that does what that kind needs, on its
ranks and in the driver (core/runner.py). Plain programs bring theirs from rank/, the Megatron
targets theirs from megatron/; a new kind of target adds its runners here and nowhere else."""

from __future__ import annotations

from ...core.runner import RankGroupRunner, TargetRunner
from ...core.target import Target, TargetKind
from ...megatron.runners import RUNNERS as MEGATRON_RUNNERS
from ...rank.programs import RUNNERS as PROGRAM_RUNNERS

RUNNERS: dict[TargetKind, TargetRunner] = {
    **PROGRAM_RUNNERS,
    **MEGATRON_RUNNERS,
    TargetKind.GROUP: RankGroupRunner(),
}


def runner_for(target: Target) -> TargetRunner:
    return RUNNERS[target.kind]
