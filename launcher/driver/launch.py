"""A launch from start to end, read top-down: preflight, connect, then the controller
(driver/controller.py) steps through the states of each attempt (driver/attempt.py) until one
succeeds or the failure policy gives up; the run directory records it all, however it ends.
"""

from __future__ import annotations

import logging
import math
import signal
from dataclasses import replace
from typing import Any

from ..core.errors import Interrupted
from ..core.outcome import run_outcome
from ..core.policy import FailurePolicy
from ..core.profiles import load_profile
from ..core.progress import TrainingFacts
from ..core.spec import LaunchSpec
from ..core.target import Target, TargetKind, check_target_locally
from ..megatron.preflight import preflight
from .attempt import Attempt, LaunchResult
from .cluster import connect
from .controller import Controller
from .progress_view import ProgressView
from .rundir import RunDir, runs_root
from .spares import SparePool
from .supervise import StopSignal

log = logging.getLogger("megaray")

__all__ = ["LaunchResult", "launch"]


def launch(spec: LaunchSpec) -> LaunchResult:
    """Run `spec` on the cluster and return when every rank has finished; raises MegarayError.

    The run directory (`spec.run_dir`) records the spec, the resolved config, the topology, each
    rank's environment and output, and a summary of how it ended, whatever the outcome.
    """
    try:
        return _launch(spec)
    except KeyboardInterrupt:  # before megaray's own handler is installed: preflight, connecting
        raise Interrupted(signal.SIGINT, "SIGINT") from None
    except SystemExit as e:  # Ray's driver handler turns SIGTERM into sys.exit(15)
        if e.code != signal.SIGTERM:
            raise
        raise Interrupted(signal.SIGTERM, "SIGTERM") from None


def _launch(spec: LaunchSpec) -> LaunchResult:
    check_target_locally(spec.target, spec.cwd)
    profile = load_profile(spec.env_profile) if spec.env_profile else {}
    plan = preflight(spec)
    runs_root(spec.run_dir)  # bad input, said before connecting
    stop = StopSignal()
    progress = ProgressView(plan.facts if plan else TrainingFacts(), spec.world_size, spec.peak_tflops)
    controller: Controller | None = None
    run: RunDir | None = None  # made once connected: a launch that never reached a cluster left nothing
    error: BaseException | None = None
    try:
        # After connecting: ray.init installs its own fatal-signal handler for SIGTERM, which would
        # end the driver without teardown.
        with connect(spec) as cluster, stop.installed():
            run = RunDir(spec.run_dir)
            run.write_spec(spec)
            if plan is not None:
                run.write_config(plan.config)
            if spec.forwarded:
                names = ", ".join(k for k, _ in spec.forwarded)
                log.info("every rank gets these variables of this shell (values not shown): %s", names)
            first_target = align_timeouts(spec, plan)

            def new_attempt(k: int, spares: SparePool | None) -> Attempt:
                target = first_target if k == 0 else resume_target(first_target, plan)
                return Attempt(replace(spec, target=target), k, cluster, profile, stop, run, progress, spares)

            controller = Controller(
                FailurePolicy(spec.max_restarts), new_attempt, placement_timeout_s=spec.placement_timeout_s,
                on_state=progress.on_state,
            )  # fmt: skip
            try:
                return controller.run()
            finally:
                from .pool import refill

                refill()
    except BaseException as e:
        error = e
        raise
    finally:
        if run is not None:
            _record(run, spec, error, controller, progress)


def _record(
    run: RunDir, spec: LaunchSpec, error: BaseException | None, controller: Controller | None,
    progress: ProgressView,
) -> None:  # fmt: skip
    """summary.json: how the launch ended, its restarts, the states it went through, its timings."""
    attempt = controller.last_attempt if controller else None
    run.write_summary(
        job=spec.job_name,
        world_size=spec.world_size,
        **run_outcome(error).summary(),
        restarts=[r.record() for r in controller.restarts] if controller else [],
        states=[{"state": s, "at": at} for s, at in controller.history] if controller else [],
        timings=attempt.timings if attempt is not None else {},
        progress={**progress.stats, "first_report_at": progress.first_at} if progress.stats else {},
    )
    log.info("run directory: %s", run.path)


def align_timeouts(spec: LaunchSpec, plan: Any) -> Target:
    """Megatron's collective timeout must outlast --hang-timeout, so a hang is caught here, with
    stacks, and not by NCCL's watchdog: raise `dist.distributed_timeout_minutes` unless set by hand."""
    target = spec.target
    if target.kind is not TargetKind.MEGATRON or plan is None or not spec.hang_timeout_s:
        return target
    minutes = plan.config.dist.distributed_timeout_minutes
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


def resume_target(target: Target, plan: Any) -> Target:
    """The target of a relaunch: a Megatron recipe that saves checkpoints loads the latest of them
    (bridge resumes the iteration count from `checkpoint.load`); other programs resume themselves,
    as under torchrun (TORCHELASTIC_RESTART_COUNT tells them it is a restart).

    Pretraining recipes load nothing; finetuning recipes load from their default save folder, so a
    `checkpoint.save` given alone would leave the relaunch loading elsewhere. A `checkpoint.load`
    given on the command line is kept; one from the recipe gives way once the save folder holds a
    checkpoint (before that, the relaunch starts as the first attempt did: the pretrained weights)."""
    if target.kind is not TargetKind.MEGATRON or plan is None:
        return target
    from ..megatron.bridge_target import has_checkpoint

    ckpt = plan.config.checkpoint
    if not ckpt.save or ckpt.load == ckpt.save or any(a.startswith("checkpoint.load=") for a in target.args):
        return target
    if ckpt.load and not has_checkpoint(ckpt.save):
        return target
    log.info("the relaunch resumes from the recipe's checkpoints: checkpoint.load=%s", ckpt.save)
    return replace(target, args=(*target.args, f"checkpoint.load={ckpt.save}"))
