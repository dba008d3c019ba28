"""A launch from start to end, read top-down: preflight, connect, then the controller
(driver/controller.py) steps through the states of each attempt (driver/attempt.py) until one
succeeds or the failure policy gives up; the run directory records it all, however it ends.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import replace

from ..core.elastic import GrowPolicy
from ..core.errors import Interrupted
from ..core.outcome import run_outcome
from ..core.policy import FailurePolicy
from ..core.profiles import load_profile
from ..core.progress import TrainingFacts
from ..core.spec import LaunchSpec
from ..core.target import check_target_locally
from .attempt import Attempt, LaunchResult
from .cluster import connect
from .controller import Controller
from .metrics import JobMetrics
from .progress_view import ProgressView
from .rundir import RunDir, runs_root
from .spares import SparePool
from .stop import EarlyInterrupt, StopSignal
from .targets import runner_for

log = logging.getLogger("megaray")

__all__ = ["LaunchResult", "launch"]


def launch(spec: LaunchSpec, *, exits_after: bool = False) -> LaunchResult:
    """Run `spec` on the cluster and return when every rank has finished; raises MegarayError.

    The run directory (`spec.run_dir`) records the spec, the resolved config, the topology, each
    rank's environment and output, and a summary of how it ended, whatever the outcome.
    `exits_after`: the process ends when the command returns (driver/cluster.py `connect`).
    """
    try:
        with EarlyInterrupt().installed() as early:
            return _launch(spec, exits_after, early)
    except KeyboardInterrupt:  # before megaray's own handler is installed: preflight, connecting
        raise Interrupted(signal.SIGINT, "SIGINT") from None
    except SystemExit as e:  # Ray's driver handler turns SIGTERM into sys.exit(15)
        if e.code != signal.SIGTERM:
            raise
        raise Interrupted(signal.SIGTERM, "SIGTERM") from None


def _launch(spec: LaunchSpec, exits_after: bool, early: EarlyInterrupt) -> LaunchResult:
    check_target_locally(spec.target, spec.cwd)
    profile = load_profile(spec.env_profile) if spec.env_profile else {}
    runner = runner_for(spec.target)
    plan = runner.preflight(spec)
    early.check()  # a Ctrl-C its imports swallowed
    runs_root(spec.run_dir)  # bad input, said before connecting
    stop = StopSignal()
    progress = ProgressView(plan.facts if plan else TrainingFacts(), spec.world_size, spec.peak_tflops)
    controller: Controller | None = None
    run: RunDir | None = None  # made once connected: a launch that never reached a cluster left nothing
    error: BaseException | None = None
    try:
        # After connecting: ray.init installs its own fatal-signal handler for SIGTERM, which would
        # end the driver without teardown.
        with connect(spec, exits_after=exits_after) as cluster, stop.installed():
            early.check()
            run = RunDir(spec.run_dir)
            run.write_spec(spec)
            if plan is not None:
                run.write_config(plan.config)
            if spec.forwarded:
                names = ", ".join(k for k, _ in spec.forwarded)
                log.info("every rank gets these variables of this shell (values not shown): %s", names)
            first_target = runner.first_target(spec, plan)
            lost_nodes: set[str] = set()  # found by any attempt, avoided by the next
            grow = GrowPolicy(runner.grows_at_checkpoint, spec.grow_after_s)  # with --nodes MIN:MAX
            metrics = JobMetrics(spec.job_name, spec.metrics)  # once connected: Ray exports them

            def new_attempt(k: int, spares: SparePool | None, growing: bool) -> Attempt:
                target = first_target if k == 0 else runner.resume_target(first_target, plan)
                return Attempt(
                    replace(spec, target=target), k, cluster, profile, stop, run, progress, spares,
                    lost_nodes, size_problem=lambda nodes: runner.size_problem(spec, plan, nodes), grow=grow,
                    growing=growing, metrics=metrics, parallel_dims=lambda s: runner.parallel_dims(s, plan),
                )  # fmt: skip

            controller = Controller(
                FailurePolicy(spec.max_restarts), new_attempt, placement_timeout_s=spec.placement_timeout_s,
                min_nodes=spec.min_nodes, observers=(progress, metrics),
            )  # fmt: skip
            try:
                return controller.run()
            finally:
                metrics.close()
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
        world_size=attempt.spec.world_size if attempt is not None else spec.world_size,  # the last attempt's
        **({"nodes": str(spec.node_range)} if spec.node_range.elastic else {}),
        **run_outcome(error).summary(),
        restarts=[r.record() for r in controller.restarts] if controller else [],
        states=[{"state": s, "at": at} for s, at in controller.history] if controller else [],
        timings=attempt.timings if attempt is not None else {},
        progress={**progress.stats, "first_report_at": progress.first_at} if progress.stats else {},
    )
    log.info("run directory: %s", run.path)
