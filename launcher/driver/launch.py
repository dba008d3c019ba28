"""A launch from start to end: preflight, connect, run attempts until one succeeds or restarts run out,
and record it all in the run directory.

An attempt is a rank gang (driver/gang.py) with its output relay (driver/relay.py) and, while
restarts are left, the warm spares of the next attempt (driver/spares.py), watched by
`supervise()` (driver/supervise.py). Every exit path tears the attempt down: every actor killed,
every placement group removed (unless handed to the next attempt with its spares).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..core.errors import Interrupted, MegarayError, RankFailedError
from ..core.outcome import RunOutcome, RunStatus
from ..core.profiles import load_profile
from ..core.progress import TrainingFacts
from ..core.rankenv import redact
from ..core.spec import LaunchSpec
from ..core.target import Target, TargetKind, check_target_locally
from ..megatron.preflight import preflight
from .cluster import Cluster, connect
from .gang import RankGang
from .handle import RankInfo
from .progress_view import ProgressView
from .relay import OutputRelay
from .rundir import RunDir, runs_root
from .spares import SparePool
from .supervise import StopSignal, supervise

log = logging.getLogger("megaray")

SPARES_AFTER_S = 30.0  # spares start at the first progress report, or this long after the ranks


@dataclass(frozen=True)
class LaunchResult:
    job_name: str
    world_size: int
    master_addr: str
    master_port: int
    ranks: tuple[RankInfo, ...]
    returns: tuple[Any, ...]  # what each rank's target returned, by rank
    timings: dict[str, float] = field(default_factory=dict)


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
    restarts: list[dict[str, Any]] = []
    attempts: list[Attempt] = []
    outcome = RunOutcome(RunStatus.FAILED, 1)
    run: RunDir | None = None  # made once connected: a launch that never reached a cluster left nothing
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
                attempt = Attempt(
                    replace(spec, target=target), k, cluster, profile, stop, run, progress, spares
                )
                attempts.append(attempt)
                return attempt

            try:
                result = run_attempts(spec.max_restarts, new_attempt, restarts, spec.placement_timeout_s)
            finally:
                from .pool import refill

                refill()
        outcome = RunOutcome(RunStatus.SUCCEEDED, 0)
        return result
    except RankFailedError as e:
        e.ending = "Every other rank was stopped and the placement groups were removed."
        outcome = RunOutcome(RunStatus.FAILED, e.exit_code, str(e), e.failures)
        raise
    except Interrupted as e:
        outcome = RunOutcome(RunStatus.INTERRUPTED, e.exit_code, str(e))
        raise
    except KeyboardInterrupt:
        outcome = RunOutcome(RunStatus.INTERRUPTED, 130, "interrupted by SIGINT")
        raise
    except MegarayError as e:
        outcome = RunOutcome(RunStatus.ERROR, e.exit_code, str(e))
        raise
    except BaseException as e:
        outcome = RunOutcome(RunStatus.ERROR, 1, f"{type(e).__name__}: {e}")
        raise
    finally:
        if run is not None:
            run.write_summary(
                job=spec.job_name,
                world_size=spec.world_size,
                **outcome.summary(),
                restarts=restarts,
                timings=attempts[-1].gang.timings if attempts else {},
                progress={**progress.stats, "first_report_at": progress.first_at} if progress.stats else {},
            )
            log.info("run directory: %s", run.path)


class AttemptLike(Protocol):
    adopted: bool

    def execute(self) -> Any: ...

    def hand_over(self) -> Any: ...

    def teardown(self) -> None: ...


def run_attempts(
    max_restarts: int,
    new_attempt: Callable[[int, Any], AttemptLike],
    restarts: list[dict[str, Any]],
    placement_timeout_s: float,
) -> Any:
    """Attempt 0, then after each rank failure another, up to `max_restarts` more, as torchrun's
    --max-restarts: each restart prints the failure report, is logged with its cause and recorded in
    `restarts` (with whether warm spares took it over). The failed attempt hands its spares (and
    their placement groups) to the next one before it is torn down."""
    k, spares = 0, None
    while True:
        number = k
        attempt, spares = new_attempt(number, spares), None
        try:
            return attempt.execute()
        except RankFailedError as e:
            if number >= max_restarts:
                raise
            failed = e
            spares = attempt.hand_over()
        finally:
            attempt.teardown()  # a dead rank's last output reaches its failure here
            if number:
                restarts[number - 1]["warm_spares"] = attempt.adopted
        k = number + 1
        failed.ending = "Every other rank was stopped; the whole group is relaunched (see below)."
        print(failed.report(), file=sys.stderr, flush=True)
        restarts.append({"attempt": k, "cause": str(failed), "at": time.time()})
        how = f"waiting up to {placement_timeout_s:g}s for the layout to fit"
        how = "on the warm spares" if spares else how
        log.warning("restart %d of %d after: %s; relaunching every rank (%s)", k, max_restarts, failed, how)


class Attempt:
    """One run of every rank: a gang, its output relay, and the next attempt's warm spares."""

    def __init__(
        self,
        spec: LaunchSpec,
        number: int,
        cluster: Cluster,
        profile: dict[str, str],
        stop: StopSignal,
        run: RunDir,
        progress: ProgressView,
        spares_in: SparePool | None,
    ):
        self.spec, self.number, self.stop, self.run, self.progress = spec, number, stop, run, progress
        name = spec.job_name if number == 0 else f"{spec.job_name}-a{number}"
        self.gang = RankGang(
            spec, stop, profile=profile, name=name, attempt=number, fixed_size=cluster.fixed_size
        )
        self.spares_in = spares_in  # given by the failed attempt, until adopted or discarded
        self.spares_out: SparePool | None = None  # started for the next attempt
        self.handed_over = False
        self.relay: OutputRelay | None = None
        self.refs: list = []  # each rank's run, by rank
        self.succeeded = False
        self.failure: RankFailedError | None = None

    @property
    def adopted(self) -> bool:
        return self.gang.adopted

    def execute(self) -> LaunchResult:
        spec, gang = self.spec, self.gang
        spares_in, self.spares_in = self.spares_in, None
        gang.place(spares_in)
        self.relay = OutputRelay(
            f"{gang.name}-output",
            self.run.path,
            [s.node_rank for s in gang.slots],
            spec.console_ranks,
            self.progress,
            started=gang.pool_sink,
        )
        envs = gang.start(self.relay.sink)
        self.run.write_topology(gang.master, [dataclasses.asdict(r) for r in gang.ranks])
        self.run.write_env(
            [
                {"rank": h.slot.rank, "set_by_megaray": redact(h.env.to_set), "notes": h.env.notes,
                 "process": redact(env)}
                for h, env in zip(gang.handles, envs, strict=True)
            ]
        )  # fmt: skip
        self.refs = gang.run(spec.target, spec.cwd)
        gang.mark("started")
        try:
            returns = supervise(
                gang, self.refs, self.stop, relay=self.relay, hang_timeout_s=spec.hang_timeout_s,
                tick=self._tend_spares,
            )  # fmt: skip
        except RankFailedError as e:
            self.failure = e
            raise
        gang.mark("finished")
        try:
            gang.exit_gracefully(spec.exit_grace_s)
        except RankFailedError as e:  # a process died on its way out: its exit status, under torchrun
            self.failure = e
            raise
        self.succeeded = True
        self.relay.catch_up()  # what the ranks printed last (on their way out too), before the last word
        log.info("all %d ranks finished in %.1f s", spec.world_size, gang.timings["finished"])
        return LaunchResult(spec.job_name, spec.world_size, *gang.master, gang.ranks, returns, gang.timings)

    def _tend_spares(self) -> None:
        """Start the next attempt's spares once this one trains (they would compete with its ranks'
        own imports before), and say when they are ready."""
        spec, gang = self.spec, self.gang
        if self.spares_out is not None:
            self.spares_out.tend(self.number + 1)
            return
        ran_for = time.monotonic() - gang.t0 - gang.timings["started"]
        due = self.relay.progress_seen or ran_for >= SPARES_AFTER_S
        if spec.spares and self.number < spec.max_restarts and due:
            self.spares_out = SparePool(
                f"{spec.job_name}-a{self.number + 1}", spec.job_name, spec.target, gang.groups, gang.slots,
                gang.reports, [h.env.to_set for h in gang.handles], gang.start_env,
            )  # fmt: skip

    def hand_over(self) -> SparePool | None:
        """After a failure: the spares for the next attempt, which keeps the groups too."""
        pool = self.spares_out.hand_over() if self.spares_out is not None else None
        self.handed_over = pool is not None
        return pool

    def teardown(self) -> None:
        """Ranks still running (a peer failed, a hang, Ctrl-C) get SIGTERM and --kill-grace to end on
        it, as torchrun's do; then every actor is killed and the groups removed (unless handed over)."""
        if not self.succeeded and self.refs and self.relay is not None:
            self.relay.stop_ranks()
            self.gang.wait_stopped(self.refs, self.spec.kill_grace_s)
        self.gang.teardown(keep_groups=self.handed_over)
        if not self.succeeded and self.relay is not None and self.relay.sink is not None:
            self.gang.collect_output(self.failure)
        if self.spares_in is not None:  # given, but stopped before adopting them
            self.spares_in.discard(groups=True)
        if self.spares_out is not None and not self.handed_over:
            self.spares_out.discard(groups=False)
        if self.relay is not None:
            self.relay.finish()
        else:
            self.progress.close()


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
