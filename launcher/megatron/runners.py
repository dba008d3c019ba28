"""The Megatron targets, as the driver's registry (driver/lifecycle/registry.py) takes them: a Megatron-Bridge
recipe and the built-in dry run. What they need of the driver lives here, not there: the preflight,
the collective timeout that must outlast --hang-timeout, and where a relaunch resumes from."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, replace
from typing import Any

from ..core.layout import ParallelDims
from ..core.refs import split_ref
from ..core.runner import BASE_IMPORTS, TargetRunner, Verdict
from ..core.spec import LaunchSpec
from ..core.target import Target, TargetKind, check_dry_run_data, dry_run_trains, parse_dry_run_options
from .preflight import Plan

log = logging.getLogger("megaray")


class DryRunRunner(TargetRunner[None]):
    """The rendezvous check, then a tiny megatron-core GPT where megatron-core is installed."""

    looks_at_waits = False  # it times its forward steps (megatron/steptimes.py)
    grows_at_checkpoint = True

    def shown_as(self, target: Target) -> str:
        return "dry run (rendezvous check, then a tiny Megatron GPT where megatron-core is installed)"

    def check_locally(self, target: Target, cwd: str) -> None:
        check_dry_run_data(target.args, cwd)  # relative to the launch's working folder, as ranks read it

    def first_target(self, spec: LaunchSpec, plan: None) -> Target:
        """With `--nodes MIN:MAX` the tiny trainer keeps one layout and one global batch at every size
        (its checkpoints load at another DP size, not at another TP or PP): TP within a node as it
        chooses, no pipeline (any node count then divides), the global batch of the most nodes."""
        if not spec.node_range.elastic:
            return spec.target
        shape = dataclasses.asdict(dry_run_shape(spec))
        log.info("the dry run keeps TP %(tp)d x PP %(pp)d and a global batch of %(global_batch)d", shape)
        given = parse_dry_run_options(spec.target.args)
        fixed = [f"{k}={v}" for k, v in shape.items() if k not in given]
        return replace(spec.target, args=(*spec.target.args, *fixed))

    def size_problem(self, spec: LaunchSpec, plan: None, nodes: int) -> str | None:
        from .tiny_gpt import layout_problem

        shape = dry_run_shape(spec)
        return layout_problem(nodes * spec.gpus_per_node, shape.tp, shape.pp, shape.global_batch)

    def parallel_dims(self, spec: LaunchSpec, plan: None) -> ParallelDims | None:
        """As the tiny trainer resolves them (megatron/tiny_gpt.py)."""
        from .tiny_gpt import resolve_layout

        given = parse_dry_run_options(spec.target.args)
        tp, pp = resolve_layout(spec.world_size, spec.gpus_per_node, given.get("tp"), given.get("pp"))
        return ParallelDims(tp, pp)

    def main(self, target: Target, cwd: str) -> Any:
        from .dryrun import check_and_train

        return check_and_train(*target.args)

    def warm_imports(self, target: Target) -> tuple[str, ...]:
        if not dry_run_trains(target.args):
            return BASE_IMPORTS  # the check alone: Megatron is never imported
        from .tiny_gpt import MEGATRON_MODULES

        trainer = ("launcher.megatron.tiny_gpt", "launcher.megatron.cpu_megatron")
        return (*BASE_IMPORTS, *MEGATRON_MODULES, *trainer)


class MegatronRunner(TargetRunner[Plan]):
    """Megatron-Bridge `pretrain()`/`finetune()` with a recipe's config and the command line's overrides."""

    looks_at_waits = False  # it times its forward steps (megatron/steptimes.py)
    grows_at_checkpoint = True

    def shown_as(self, target: Target) -> str:
        return f"Megatron-Bridge pretrain(), recipe {target.name}"

    def main(self, target: Target, cwd: str) -> Any:
        from .bridge_target import train_recipe

        return train_recipe(target.recipe, list(target.args), target.hf_path)

    def warm_imports(self, target: Target) -> tuple[str, ...]:
        if target.recipe is None:
            return BASE_IMPORTS
        recipe_module, _ = split_ref(target.recipe.function)
        return (
            *BASE_IMPORTS,
            "launcher.megatron.compat:import_bridge",  # the TE-less import order, where TE is missing
            "megatron.bridge.training.gpt_step",
            "megatron.bridge.training.pretrain",
            recipe_module,
            "launcher.megatron.bridge_target",
        )

    def prepare(self, target: Target) -> None:
        """The recipe's config, built while the go is awaited (the go adds overrides at most)."""
        if target.recipe is not None:
            from .bridge_target import prebuild

            prebuild(target.recipe, list(target.args), target.hf_path)

    def preflight(self, spec: LaunchSpec) -> Verdict[Plan]:
        if spec.target.recipe is None:
            return Verdict()
        from .preflight_process import PreflightProcess

        return PreflightProcess.start(spec)

    def first_target(self, spec: LaunchSpec, plan: Plan | None) -> Target:
        return align_timeouts(spec, plan)

    def memory_problem(self, spec: LaunchSpec, plan: Plan | None, gpu_gib: float) -> str | None:
        """The preflight's estimate against the GPUs placed, unless --gpu-memory-gb was given (the
        preflight checked against that)."""
        if plan is None or spec.gpu_memory_gb is not None:
            return None
        problem = plan.memory_problem(spec.target.recipe.name, gpu_gib)
        if problem is None and plan.memory is not None:
            log.info("preflight: memory fits the %g GiB of the smallest GPU placed", gpu_gib)
        return problem

    def resume_target(self, target: Target, plan: Plan | None) -> Target:
        return resume_target(target, plan)

    def size_problem(self, spec: LaunchSpec, plan: Plan | None, nodes: int) -> str | None:
        """TP x PP x CP must divide the world, and the global batch the DP size times the micro batch
        (core/layout.py); unknown without a preflight (no bridge in the driver)."""
        if plan is None:
            return None
        from ..core.layout import layout_problems

        return "; ".join(layout_problems(plan.layout, nodes, spec.gpus_per_node)) or None

    def parallel_dims(self, spec: LaunchSpec, plan: Plan | None) -> ParallelDims | None:
        return plan.layout.dims if plan is not None else None


RUNNERS: dict[TargetKind, TargetRunner] = {
    TargetKind.MEGATRON: MegatronRunner(),
    TargetKind.DRYRUN: DryRunRunner(),
}


@dataclass(frozen=True)
class DryRunShape:
    """What the tiny trainer keeps at every node count of --nodes MIN:MAX."""

    tp: int
    pp: int
    global_batch: int


def dry_run_shape(spec: LaunchSpec) -> DryRunShape:
    """The tiny trainer's TP, PP and global batch with --nodes MIN:MAX: as given (`--dry-run tp=..
    pp=.. global_batch=..`), else its own TP, PP 1, and the global batch of the most nodes."""
    from .tiny_gpt import MICRO_BATCH, MICROBATCHES, choose_layout

    given = parse_dry_run_options(spec.target.args)
    tp, _, _ = choose_layout(spec.world_size, spec.gpus_per_node)
    tp, pp = given.get("tp", tp), given.get("pp", 1)
    dp = max(spec.world_size // (tp * pp), 1)
    return DryRunShape(tp, pp, given.get("global_batch", MICRO_BATCH * MICROBATCHES * dp))


def align_timeouts(spec: LaunchSpec, plan: Plan | None) -> Target:
    """Megatron's collective timeout must outlast --hang-timeout, so a hang is caught here, with
    stacks, and not by NCCL's watchdog: raise `dist.distributed_timeout_minutes` unless set by hand."""
    target = spec.target
    if plan is None or not spec.hang_timeout_s:
        return target
    minutes = plan.timeout_minutes
    if minutes * 60 > spec.hang_timeout_s + 60:
        return target
    if any(a.startswith("dist.distributed_timeout_minutes=") for a in target.args):
        log.warning(
            "dist.distributed_timeout_minutes=%s is not above --hang-timeout %gs: NCCL will time out before "
            "megaray reports the hang", minutes, spec.hang_timeout_s,
        )  # fmt: skip
        return target
    wanted = math.ceil((spec.hang_timeout_s + 120) / 60)
    log.info("dist.distributed_timeout_minutes=%d, above --hang-timeout %gs", wanted, spec.hang_timeout_s)
    return replace(target, args=(*target.args, f"dist.distributed_timeout_minutes={wanted}"))


def resume_target(target: Target, plan: Plan | None) -> Target:
    """The target of a relaunch: a Megatron recipe that saves checkpoints loads the latest of them
    (bridge resumes the iteration count from `checkpoint.load`); other programs resume themselves,
    as under torchrun (TORCHELASTIC_RESTART_COUNT tells them it is a restart).

    Pretraining recipes load nothing; finetuning recipes load from their default save folder, so a
    `checkpoint.save` given alone would leave the relaunch loading elsewhere. A `checkpoint.load`
    given on the command line is kept; one from the recipe gives way once the save folder holds a
    checkpoint (before that, the relaunch starts as the first attempt did: the pretrained weights)."""
    if plan is None:
        return target
    from .bridge_target import has_checkpoint

    save, load = plan.checkpoint_save, plan.checkpoint_load
    if not save or load == save or any(a.startswith("checkpoint.load=") for a in target.args):
        return target
    if load and not has_checkpoint(save):
        return target
    log.info("the relaunch resumes from the recipe's checkpoints: checkpoint.load=%s", save)
    return replace(target, args=(*target.args, f"checkpoint.load={save}"))
