"""A launch from start to end, read top-down: the preflight started, connect, then the controller
(driver/lifecycle/controller.py) steps through the states of each attempt (driver/lifecycle/attempt.py)
until one succeeds or the failure policy gives up; the run directory records it all, however it ends."""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import time
from typing import Any

from ...core.elastic import EvictPolicy, GrowPolicy, ScalingPolicy
from ...core.errors import Interrupted, MegarayError, RankFailedError, UsageError
from ...core.goodput import advice, ledger
from ...core.outcome import LaunchResult, run_outcome
from ...core.policy import FailurePolicy
from ...core.profiles import load_profile
from ...core.progress import TrainingFacts
from ...core.runner import TargetRunner, Verdict
from ...core.shellenv import shown_names
from ...core.spec import LaunchSpec
from ...core.target import Target
from ..cluster import up
from ..cluster.cluster import connect
from ..gang import placement
from ..output.metrics import JobMetrics
from ..output.progress_view import ProgressView
from ..output.rundir import RunDir, runs_root
from .attempt import Attempt
from .context import AttemptTarget, LaunchContext
from .controller import Controller
from .registry import runner_for
from .states import Placing
from .stop import EarlyInterrupt, StopSignal

log = logging.getLogger("megaray")

__all__ = ["LaunchResult", "launch"]


def launch(spec: LaunchSpec, *, exits_after: bool = False) -> LaunchResult:
    """Run `spec` on the cluster and return when every rank has finished; raises MegarayError.

    The run directory (`spec.run_dir`) records the spec, the resolved config, the topology, each
    rank's environment and output, and a summary of how it ended, whatever the outcome.
    `exits_after`: the process ends when the command returns (driver/cluster/cluster.py `connect`).
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
    runner = runner_for(spec.target)
    runner.check_locally(spec.target, spec.cwd)
    profile = load_profile(spec.env_profile) if spec.env_profile else {}
    runs_root(spec.run_dir)  # bad input, said before anything starts
    if spec.evict_after_s is not None and not (runner.grows_at_checkpoint or spec.grow_after_s):
        raise UsageError(
            "--evict-stragglers relaunches the job without a slow node while it runs: a plain program "
            "consents with --grow-after S (it resumes itself from its own checkpoints), or drop it"
        )
    verdict = runner.preflight(spec)  # on its way while the driver connects and the ranks start
    try:
        return _run(spec, exits_after, early, runner, verdict, profile)
    finally:
        verdict.cancel()


class _Plan:
    """The preflight's plan, waited for where it is first needed: the first attempt's target, just
    before its program starts (or, with --nodes MIN:MAX or metrics, where placing or labelling needs
    the layout). A refusal raises there, or in any wait loop before (StopSignal's `also`)."""

    def __init__(self, verdict: Verdict, stop: StopSignal, progress: ProgressView):
        self.verdict, self.stop, self.progress = verdict, stop, progress
        self.run: RunDir | None = None
        self._plan: list[Any] = []

    def __call__(self) -> Any:
        if not self._plan:
            t0 = time.monotonic()
            plan = self.verdict.result(self.stop.check)
            if self.verdict.in_background and (waited := time.monotonic() - t0) >= 0.1:
                log.info("waited %.1f s for the preflight", waited)
            if plan is not None:
                self.progress.facts = plan.facts
                if self.run is not None:
                    self.run.write_config(plan.config_yaml)
            self._plan.append(plan)
        return self._plan[0]


def _run(
    spec: LaunchSpec, exits_after: bool, early: EarlyInterrupt, runner: TargetRunner, verdict: Verdict,
    profile: dict[str, str],
) -> LaunchResult:  # fmt: skip
    early.check()  # a Ctrl-C swallowed so far
    stop = StopSignal(also=verdict.ready)
    progress = ProgressView(TrainingFacts(), spec.world_size, spec.peak_tflops)
    plan = _Plan(verdict, stop, progress)
    controller: Controller | None = None
    run: RunDir | None = None  # made once connected: a launch that never reached a cluster left nothing
    error: BaseException | None = None
    try:
        # After connecting: ray.init installs its own fatal-signal handler for SIGTERM, which would
        # end the driver without teardown.
        with connect(spec, exits_after=exits_after, hold_interrupts=early.held) as cluster, stop.installed():
            early.check()
            stop.check()  # a refusal that came while connecting
            run = plan.run = RunDir(spec.run_dir)
            run.write_spec(spec)
            if spec.forwarded:
                log.info("every rank gets %d variables of this shell (values not shown): %s",
                         len(spec.forwarded), shown_names([k for k, _ in spec.forwarded]))  # fmt: skip
            first: list[Target] = []

            def first_target(gpu_gib: float | None = None, ready: tuple[Any, Any] | None = None) -> Target:
                """`gpu_gib`: the smallest placed GPU's memory, which the plan's estimate must fit;
                `ready`: rank 0's process and the call after which it has the target's stack
                imported (None: already), which may answer for the preflight quicker."""
                if not first:
                    if ready is not None:
                        verdict.ask(*ready)
                    p = plan()
                    if gpu_gib is not None and (problem := runner.memory_problem(spec, p, gpu_gib)):
                        verdict.refusal = UsageError(problem)  # the preflight's, completed: bad input
                        raise verdict.refusal
                    first.append(runner.first_target(spec, p))
                return first[0]

            ctx = LaunchContext(
                spec, cluster, profile, stop, run, progress,
                metrics=JobMetrics(  # once connected: Ray exports them
                    spec.job_name, spec.metrics,
                    goodput=lambda: ledger(progress.goodput, run.started, time.time(), live=True),
                ),
                scaling=ScalingPolicy(  # with --nodes MIN:MAX
                    spec.node_range,
                    lambda nodes: runner.size_problem(spec, plan(), nodes),
                    GrowPolicy(runner.grows_at_checkpoint, spec.grow_after_s),
                    EvictPolicy(spec.evict_after_s),
                ),
                parallel_dims=lambda s: runner.parallel_dims(s, plan()),
            )  # fmt: skip

            def new_attempt(placing: Placing) -> Attempt:
                # the first attempt's target once its ranks are started (they import meanwhile); a
                # relaunch's resumes from what the first saved
                if placing.number == 0:
                    target = AttemptTarget(later=first_target, imports_first=verdict.in_background)
                else:
                    target = AttemptTarget(known=runner.resume_target(first_target(), plan()))
                return Attempt(ctx, placing, target)

            controller = Controller(
                FailurePolicy(spec.max_restarts), new_attempt,
                placement_timeout_s=placement.wait_s(spec, cluster.fixed_size),
                min_nodes=spec.min_nodes, observers=(progress, ctx.metrics),
            )  # fmt: skip
            try:
                return controller.run()
            except RankFailedError as e:
                if cluster.up_address and up.stopped_under(cluster.up_address):  # #46: not a crash
                    e.ending = f"{UP_STOPPED} {e.ending}".strip()
                raise
            finally:
                ctx.metrics.close(ledger(progress.goodput, run.started, time.time()))
                from ..cluster.pool import refill

                refill(runner.warm_imports(spec.target))
    except BaseException as e:
        error = e
        if isinstance(e, MegarayError) and not isinstance(e, Interrupted) and verdict.in_background:
            # a failure while the preflight was still out (no room to place, a rank dying as it
            # imports): a recipe it refuses is the root cause to tell, as bad input (seconds away)
            with contextlib.suppress(MegarayError):
                verdict.result()
            if verdict.refusal is not None:
                error = verdict.refusal
                raise error from None
        raise
    finally:
        if run is not None and error is not None and error is verdict.refusal:
            shutil.rmtree(run.path, ignore_errors=True)  # bad input leaves nothing behind
        elif run is not None:
            _record(run, spec, error, controller, progress)


UP_STOPPED = (
    "The local Ray of `megaray up` this launch ran on was stopped meanwhile (`megaray down`): its ranks "
    "ended with it."
)


def _record(
    run: RunDir, spec: LaunchSpec, error: BaseException | None, controller: Controller | None,
    progress: ProgressView,
) -> None:  # fmt: skip
    """summary.json: how the launch ended, its restarts, the states it went through, its timings,
    and where its time went (core/goodput.py), also said in one line where iterations were reported."""
    attempt = controller.last_attempt if controller else None
    spent = ledger(progress.goodput, run.started, time.time())
    if spent is not None:
        log.info("%s", spent.describe())
    interval = advice(progress.goodput, spent.wall_s) if spent is not None else None
    advised = {"advice": interval.describe()} if interval is not None and interval.far else {}
    if advised:  # the checkpoint interval far from what the save cost and the failures suggest
        log.info("%s", advised["advice"])
    run.write_summary(
        job=spec.job_name,
        world_size=attempt.spec.world_size if attempt is not None else spec.world_size,  # the last attempt's
        **({"nodes": str(spec.node_range)} if spec.node_range.elastic else {}),
        **run_outcome(error).summary(),
        restarts=[r.record() for r in controller.restarts] if controller else [],
        states=[{"state": s, "at": at} for s, at in controller.history] if controller else [],
        timings=attempt.timings if attempt is not None else {},
        progress={**progress.stats, "first_report_at": progress.first_at} if progress.stats else {},
        goodput={**spent.record(), **advised} if spent is not None else None,
    )
    log.info("run directory: %s", run.path)
