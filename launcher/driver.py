"""The launch itself: place, order, start one actor per rank, set the env, run, supervise, clean up.

This is the only module that sequences Ray calls; the decisions it applies (rank order, env,
ports, failure reports) come from pure functions elsewhere. Every exit path goes through
`_Job.teardown()`, which kills every actor and removes every placement group.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.util
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from . import placement, ports
from .cluster import NAMESPACE, Cluster, check_versions, connect
from .errors import (
    ClusterError,
    Interrupted,
    MegarayError,
    RankFailedError,
    RankFailure,
    ResourceError,
    UsageError,
    describe_death,
)
from .output import OutputSink
from .preflight import preflight
from .profiles import load_profile
from .progress import ProgressView, TrainingFacts
from .rankenv import EnvDecision, contract_env, decide_env, redact
from .rundir import RunDir
from .spares import Spares, warm_steps
from .spec import LaunchSpec, Target
from .topology import (
    RankSlot,
    assign_ranks,
    format_rank_ranges,
    format_table,
    order_nodes,
    visible_devices,
)
from .worker import RankActor

log = logging.getLogger("megaray")

ACTOR_START_TIMEOUT_S = 300.0  # covers runtime-env set-up and image pulls on first use of a node
ROOT_CAUSE_WINDOW_S = 0.1  # failures arriving this close together are compared to find the first
STARTUP_GRACE_S = 120.0  # the least silence allowed before the first line of any rank
SPARES_AFTER_S = 30.0  # spares start at the first progress report, or this long after the ranks
SPARE_ANSWER_S = 10.0  # a warm spare answers at once; one that does not is on a lost node


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    node_rank: int
    node_ip: str
    hostname: str
    gpu: str
    pid: int


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
    check_target_locally(spec.target, spec.cwd)
    profile = load_profile(spec.env_profile) if spec.env_profile else {}
    plan = preflight(spec)
    run = RunDir(spec.run_dir)
    run.write_spec(spec)
    if plan is not None:
        run.write_config(plan.config)
    stop = _StopSignal()
    job: _Job | None = None
    progress = ProgressView(plan.facts if plan else TrainingFacts(), spec.world_size, spec.peak_tflops)
    restarts: list[dict[str, Any]] = []
    outcome: dict[str, Any] = {"status": "failed", "exit_code": 1, "root_cause": None}
    try:
        # After connecting: ray.init installs its own fatal-signal handler for SIGTERM, which would
        # end the driver without teardown.
        with connect(spec) as cluster, stop.installed():
            attempt = 0
            first_target = align_timeouts(spec, plan)
            spares: Spares | None = None
            while True:
                target = first_target if attempt == 0 else resume_target(first_target, plan)
                job = _Job(replace(spec, target=target), cluster, profile, stop, run=run, progress=progress,
                           attempt=attempt, spares=spares)  # fmt: skip
                spares = None
                try:
                    result = job.execute()
                    break
                except RankFailedError as e:
                    if attempt >= spec.max_restarts:
                        raise
                    attempt += 1
                    print(e.report(), file=sys.stderr, flush=True)
                    restarts.append({"attempt": attempt, "cause": str(e), "at": time.time()})
                    spares = job.hand_over()
                    log.warning(
                        "restart %d of %d after: %s; relaunching every rank (%s)", attempt, spec.max_restarts,
                        e, "on the warm spares" if spares else
                        f"waiting up to {spec.placement_timeout_s:g}s for the layout to fit",
                    )  # fmt: skip
                finally:
                    job.teardown()
                    if job.attempt:
                        restarts[job.attempt - 1]["warm_spares"] = job.adopted
        outcome = {"status": "succeeded", "exit_code": 0, "root_cause": None}
        return result
    except RankFailedError as e:
        outcome = {"status": "failed", "exit_code": e.exit_code, "root_cause": str(e), "failures": e.failures}
        raise
    except Interrupted as e:
        outcome = {"status": "interrupted", "exit_code": e.exit_code, "root_cause": str(e)}
        raise
    except MegarayError as e:
        outcome = {"status": "error", "exit_code": e.exit_code, "root_cause": str(e)}
        raise
    except BaseException as e:
        outcome = {"status": "error", "exit_code": 1, "root_cause": f"{type(e).__name__}: {e}"}
        raise
    finally:
        run.write_summary(
            job=spec.job_name,
            world_size=spec.world_size,
            **outcome,
            restarts=restarts,
            timings=job.timings if job else {},
            progress=progress.stats,
        )
        log.info("run directory: %s", run.path)


def align_timeouts(spec: LaunchSpec, plan: Any) -> Target:
    """Megatron's collective timeout must outlast --hang-timeout, so a hang is caught here, with
    stacks, and not by NCCL's watchdog: raise `dist.distributed_timeout_minutes` unless set by hand."""
    target = spec.target
    if target.kind != "megatron" or plan is None or not spec.hang_timeout_s:
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
    as under torchrun (TORCHELASTIC_RESTART_COUNT tells them it is a restart)."""
    if target.kind != "megatron" or plan is None:
        return target
    ckpt = plan.config.checkpoint
    if not ckpt.save or ckpt.load or any(a.startswith("checkpoint.load=") for a in target.args):
        return target
    log.info("the relaunch resumes from the recipe's checkpoints: checkpoint.load=%s", ckpt.save)
    return replace(target, args=(*target.args, f"checkpoint.load={ckpt.save}"))


def check_target_locally(target: Target, cwd: str) -> None:
    """Catch a missing script or entrypoint in the driver, before anything is placed.

    The entrypoint's module is located and parsed, not imported: importing user code in the driver
    could import torch or start work there.
    """
    if target.kind == "script":
        path = os.path.join(cwd, target.name)
        if not os.path.isfile(path):
            raise UsageError(
                f"script {target.name} not found (looked in {cwd}); give the path of a Python file"
            )
        return
    if target.kind not in ("module", "entrypoint"):
        return
    module_name, _, func_name = target.name.partition(":")
    sys.path.insert(0, cwd)
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        found = None
    finally:
        sys.path.remove(cwd)
    flag = "--entrypoint" if target.kind == "entrypoint" else "-m"
    if found is None:
        raise UsageError(
            f"{flag} {target.name}: no module named {module_name} in {cwd} or the installed packages; "
            "check the spelling or install the package"
        )
    if target.kind == "entrypoint" and found.origin and found.origin.endswith(".py"):
        names = _top_level_names(found.origin)
        if names is not None and func_name not in names:
            raise UsageError(
                f"--entrypoint {target.name}: {module_name} ({found.origin}) defines no {func_name}; "
                "name a function defined at the top level of that module"
            )


def _top_level_names(path: str) -> set[str] | None:
    """Names bound at module level, or None when they cannot be known statically (star imports)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    names: set[str] = set()
    for node in ast.walk(tree):  # nested names count too: a superset never rejects a real function
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    if "__getattr__" in names:  # a module-level __getattr__ can provide any name
        return None
    return names


class _StopSignal:
    """SIGINT/SIGTERM in the driver: remembered by the handler, acted on by the wait loops.

    Raising from the handler would unwind through Ray's C++ wait and surface as a SystemError; the
    loops wait in short slices and call `check()`, which raises `Interrupted` so teardown runs.
    """

    def __init__(self):
        self.signum: int | None = None

    def check(self) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum, signal.Signals(self.signum).name)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, _frame):
            if self.signum is not None:  # a second signal while stopping: stop waiting for anything
                raise Interrupted(signum, signal.Signals(signum).name)
            self.signum = signum

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def wait_all(refs: list, timeout_s: float, stop: _StopSignal) -> list:
    """`ray.wait` for all refs, in slices so a stop signal is seen quickly; returns the ready ones."""
    want = len(refs)
    deadline = time.monotonic() + timeout_s
    ready: list = []
    while True:
        stop.check()
        left = deadline - time.monotonic()
        if len(ready) >= want or left <= 0:
            return ready
        ready, _ = ray.wait(refs, num_returns=want, timeout=min(left, 0.25))


class _Job:
    def __init__(
        self,
        spec: LaunchSpec,
        cluster: Cluster,
        profile: dict[str, str],
        stop: _StopSignal,
        *,
        gpu_share: float = 1.0,
        colocate_with: _Job | None = None,
        run: RunDir | None = None,
        progress: ProgressView | None = None,
        attempt: int = 0,
        spares: Spares | None = None,
    ):
        self.spec = spec
        self.gpu_share = gpu_share  # of each rank's GPU (and CPUs) that this job's actor takes
        self.host = colocate_with  # a job whose placement groups this one's actors share
        self.stop = stop
        self.cluster = cluster
        self.profile = profile
        self.groups: list = []
        self.actors: list = []  # by rank
        self.slots: list[RankSlot] = []
        self.port_reserved: tuple[str, int] | None = None
        self.infos: list[dict[str, Any]] = []  # what each rank's actor reported, by rank
        self.ranks: tuple[RankInfo, ...] = ()
        self.master: tuple[str, int] = ("", 0)
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}
        # A launch (not a rank group) collects rank output into its run directory and shows progress.
        self.run = run
        self.sink = None
        self.drain_ref = None
        self.progress = progress
        self.attempt = attempt
        # Names of this attempt's actors and groups: those of a previous attempt may still be dying.
        self.name = spec.job_name if attempt == 0 else f"{spec.job_name}-a{attempt}"
        self.last_activity = time.monotonic()
        self.writes_seen = 0
        self.progress_seen = False
        # Warm spares: those this attempt was given (until it adopts or discards them), and those it
        # starts for the next one.
        self.spares_in = spares
        self.adopted = False
        self.next_spares: Spares | None = None
        self.spares_ready = False
        self.handed_over = False
        self.replaced_pids: list[int | None] = [None] * spec.world_size
        self.decided_env: list[dict[str, str]] = []

    def _mark(self, name: str) -> None:
        self.timings[name] = round(time.monotonic() - self.t0, 3)

    # -- the launch, step by step ------------------------------------------------------------
    def execute(self) -> LaunchResult:
        spec = self.spec
        self.prepare()
        returns = self.supervise([a.run.remote(spec.target, spec.cwd) for a in self.actors])
        self._mark("finished")
        log.info("all %d ranks finished in %.1f s", spec.world_size, self.timings["finished"])
        return LaunchResult(
            spec.job_name, spec.world_size, self.master[0], self.master[1], self.ranks, returns, self.timings
        )

    def prepare(self) -> None:
        """Everything up to running the target: groups, actors, port, each rank's env."""
        spec = self.spec
        log.info(
            "job %s: %d node(s) x %d rank(s) = %d, target: %s",
            spec.job_name,
            spec.nodes,
            spec.gpus_per_node,
            spec.world_size,
            spec.target.describe(),
        )
        self._place()
        if self.run is not None:
            self._start_sink()
        infos = self._start_actors()
        master_addr = self.slots[0].node_ip
        master_port = self._choose_port(master_addr)
        decisions = self._decide_envs(infos, master_addr, master_port)
        envs = ray.get(
            [
                a.setup.remote(d.to_set, self.sink, i["gpu_ids"] if self.adopted else None, old)
                for a, d, i, old in zip(self.actors, decisions, infos, self.replaced_pids, strict=True)
            ]
        )
        self.decided_env = [d.to_set for d in decisions]
        self._mark("env_set")
        ranks = tuple(
            RankInfo(
                s.rank, s.local_rank, s.node_rank, s.node_ip, i["hostname"], ",".join(i["gpu_ids"]), i["pid"]
            )
            for s, i in zip(self.slots, infos, strict=True)
        )
        self._log_topology(ranks, master_addr, master_port)
        self._log_env(decisions)
        self.infos, self.ranks, self.master = infos, ranks, (master_addr, master_port)
        if self.run is not None:
            self.run.write_topology(self.master, [dataclasses.asdict(r) for r in ranks])
            self.run.write_env(
                [
                    {"rank": r, "set_by_megaray": redact(d.to_set), "notes": d.notes, "process": redact(env)}
                    for r, (d, env) in enumerate(zip(decisions, envs, strict=True))
                ]
            )

    def _start_sink(self) -> None:
        """The output collector, on the driver's node: the run directory is on this machine."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec = self.spec
        self.sink = (
            ray.remote(OutputSink)
            .options(
                name=f"{self.name}-output",
                namespace=NAMESPACE,
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    ray.get_runtime_context().get_node_id(), soft=False
                ),
            )
            .remote(str(self.run.path.resolve()), [s.node_rank for s in self.slots], spec.console_ranks)
        )

    def pump_output(self, wait_s: float = 0.0) -> None:
        """Show what the sink collected since the last call: console lines and progress."""
        if self.sink is None:
            return
        if self.drain_ref is None:
            self.drain_ref = self.sink.drain.remote()
        ready, _ = ray.wait([self.drain_ref], timeout=wait_s)
        if not ready:
            return
        ref, self.drain_ref = self.drain_ref, None
        try:
            lines, records, writes = ray.get(ref)
        except ray.exceptions.RayError as e:
            log.warning("rank output is no longer collected: %s", _first_line(e))
            self.sink = None
            return
        self._show(lines, records, writes)

    def _show(self, lines: list[str], records: list[dict[str, Any]], writes: int) -> None:
        if writes != self.writes_seen:
            self.writes_seen, self.last_activity = writes, time.monotonic()
        self.progress.print_lines(lines)
        for record in records:
            self.progress.update(record)
            self.progress_seen = True

    def _place(self) -> None:
        spec = self.spec
        if self.spares_in is not None and self._adopt():
            self._mark("placed")
            return
        if self.host is not None:  # colocated: the same bundles, so the same nodes, ranks and GPUs
            self.groups, self.slots = self.host.groups, self.host.slots
            self._mark("placed")
            return
        problem = placement.feasibility_problem(spec)
        if problem and self.cluster.fixed_size:
            raise placement.resource_error(spec, 0, problem, placement.describe_nodes(), can_grow=False)
        if problem:
            log.warning("%s; waiting up to %gs for more nodes", problem, spec.placement_timeout_s)
        before = placement.describe_nodes()  # what others left free, for the message if we time out
        self.groups = placement.create_groups(spec, self.name)
        placed = len(wait_all([g.ready() for g in self.groups], spec.placement_timeout_s, self.stop))
        if placed < len(self.groups):
            why = f"not placed within {spec.placement_timeout_s:g}s"
            raise placement.resource_error(
                spec,
                placed,
                f"{problem}; {why}" if problem else why,
                before,
                can_grow=not self.cluster.fixed_size,
            )
        self._mark("placed")
        self.slots = assign_ranks(order_nodes(placement.resolve_nodes(self.groups)), spec.gpus_per_node)

    def _start_actors(self) -> list[dict[str, Any]]:
        spec = self.spec
        if self.adopted:
            self._mark("actors_ready")
            check_versions(self.infos)
            return self.infos
        actor_cls = ray.remote(RankActor)
        for s in self.slots:
            self.actors.append(
                actor_cls.options(
                    name=f"{self.name}-rank{s.rank}",
                    namespace=NAMESPACE,
                    num_cpus=spec.cpus_per_rank * self.gpu_share,
                    num_gpus=self.gpu_share if spec.uses_gpus else 0,
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.groups[s.group], placement_group_bundle_index=s.bundle
                    ),
                ).remote(spec.job_name, s.rank, s.node_ip)
            )
        refs = [a.info.remote() for a in self.actors]
        ready = wait_all(refs, ACTOR_START_TIMEOUT_S, self.stop)
        if len(ready) < len(refs):
            raise ResourceError(
                f"{len(refs) - len(ready)} of {len(refs)} rank actors did not start within "
                f"{ACTOR_START_TIMEOUT_S:g}s (runtime environment set-up?); check `ray status` and the "
                "raylet logs of their nodes"
            )
        try:
            infos = ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise ClusterError(
                f"a rank actor failed to start: {_first_line(e)}; is megaray installed on every node "
                "with the driver's Python?"
            ) from None
        self._mark("actors_ready")
        check_versions(infos)
        return infos

    # -- warm spares (spares.py) ------------------------------------------------------------------
    def _tend_spares(self) -> None:
        """Start the next attempt's spares once this one trains (they would compete with its ranks'
        own imports before), and say when they are ready."""
        spec = self.spec
        if self.next_spares is None:
            wanted = spec.spares and self.run is not None and self.host is None
            due = self.progress_seen or time.monotonic() - self.t0 - self.timings["started"] >= SPARES_AFTER_S
            if wanted and self.attempt < spec.max_restarts and due:
                self._start_spares()
            return
        if self.spares_ready:
            return
        refs = self.next_spares.warm_refs
        if len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            return
        self.spares_ready = True
        try:
            results = ray.get(refs)
        except ray.exceptions.RayError as e:
            log.warning("a warm spare failed: %s; a restart will place every rank anew", _first_line(e))
            return
        failed = sorted({step for r in results for step in r["failed"]})
        log.info(
            "%d warm spare(s) ready for restart %d in %.1f s%s",
            len(results),
            self.attempt + 1,
            time.monotonic() - self.next_spares.started_at,
            f" (could not import {', '.join(failed)}: the ranks will)" if failed else "",
        )

    def _start_spares(self) -> None:
        spec = self.spec
        name = f"{spec.job_name}-a{self.attempt + 1}"
        steps = warm_steps(spec.target)
        actor_cls = ray.remote(RankActor)
        actors = [
            actor_cls.options(
                name=f"{name}-rank{s.rank}",
                namespace=NAMESPACE,
                num_cpus=0,  # the bundle holds the rank's resources; the spare takes them over
                num_gpus=0,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.groups[s.group], placement_group_bundle_index=s.bundle
                ),
            ).remote(spec.job_name, s.rank, s.node_ip)
            for s in self.slots
        ]
        self.next_spares = Spares(
            actors=actors,
            warm_refs=[a.warm.remote(env, steps) for a, env in zip(actors, self.decided_env, strict=True)],
            groups=self.groups,
            slots=self.slots,
            gpu_ids=[i["gpu_ids"] for i in self.infos],
            replaces_pids=[i["pid"] for i in self.infos],
            started_at=time.monotonic(),
        )
        log.info("starting %d warm spare(s) for a restart (importing %s)", len(actors), ", ".join(steps))

    def hand_over(self) -> Spares | None:
        """After a failure: this attempt's spares for the next one, which keeps the groups too."""
        if self.next_spares is None:
            return None
        self.handed_over = True
        return self.next_spares

    def _adopt(self) -> bool:
        """Take the previous attempt's spares as this attempt's ranks, if all of them can."""
        sp = self.spares_in
        problem = self._spares_problem(sp)
        self.spares_in = None
        if problem:
            log.warning("the warm spares cannot take over (%s): placing every rank anew", problem)
            sp.kill(groups=True)
            return False
        self.groups, self.slots, self.actors = sp.groups, sp.slots, list(sp.actors)
        self.replaced_pids = list(sp.replaces_pids)
        self.adopted = True
        return True

    def _spares_problem(self, sp: Spares) -> str | None:
        """Why the spares cannot take over, or None. A spare on a lost node may not be known dead to
        Ray yet: it does not answer, and that is enough."""
        from ray.util.placement_group import placement_group_table

        for g in sp.groups:
            state = placement_group_table(g).get("state")
            if state != "CREATED":
                return f"placement group {g.id.hex()[:8]} is {state}: a node was lost"
        warmed = wait_all(sp.warm_refs, ACTOR_START_TIMEOUT_S, self.stop)
        if len(warmed) < len(sp.warm_refs):
            late = len(sp.warm_refs) - len(warmed)
            return f"{late} spare(s) still importing after {ACTOR_START_TIMEOUT_S:g}s"
        pings = [a.info.remote() for a in sp.actors]
        answered = wait_all(pings, SPARE_ANSWER_S, self.stop)
        if len(answered) < len(pings):
            return f"{len(pings) - len(answered)} spare(s) did not answer within {SPARE_ANSWER_S:g}s"
        try:
            results, infos = ray.get(sp.warm_refs), ray.get(pings)
        except ray.exceptions.RayError as e:
            return f"a spare died: {_first_line(e)}"
        cuda = [r for r, w in enumerate(results) if w["cuda_initialized"]]
        if cuda:
            return (
                f"importing initialized CUDA in the spare(s) of rank(s) {format_rank_ranges(cuda)}, which "
                "would leave a context on the node's first GPU"
            )
        for info, ids in zip(infos, sp.gpu_ids, strict=True):
            info["gpu_ids"] = ids
        self.infos = infos
        return None

    def _choose_port(self, master_addr: str) -> int:
        spec = self.spec
        found = ray.get(self.actors[0].free_ports.remote(spec.job_name, 16, spec.master_port))
        if spec.master_port is not None and not found:
            raise UsageError(
                f"--master-port {spec.master_port} is in use on the master node {master_addr}; choose "
                "another port or leave --master-port out to pick a free one"
            )
        port = ports.reserve(master_addr, found, self.name)
        if port is not None:
            self.port_reserved = (master_addr, port)  # ours to release at teardown
            return port
        if spec.master_port is not None:
            return spec.master_port  # asked for explicitly: another job's reservation does not bind it
        raise ResourceError(f"no free port for MASTER_PORT on {master_addr}; pass --master-port")

    def _decide_envs(
        self, infos: list[dict[str, Any]], master_addr: str, master_port: int
    ) -> list[EnvDecision]:
        spec = self.spec
        by_node: dict[int, list[list[str]]] = {}
        for s, i in zip(self.slots, infos, strict=True):
            by_node.setdefault(s.node_rank, []).append(i["gpu_ids"])
        visible = {n: visible_devices(ids) for n, ids in by_node.items()}
        decisions = []
        for s, i in zip(self.slots, infos, strict=True):
            contract = contract_env(
                s,
                world_size=spec.world_size,
                local_world_size=spec.gpus_per_node,
                num_nodes=spec.nodes,
                master_addr=master_addr,
                master_port=master_port,
                run_id=spec.job_name,
                restart_count=self.attempt,
                max_restarts=spec.max_restarts,
                visible_devices=visible[s.node_rank],
            )
            decisions.append(
                decide_env(
                    contract,
                    node_env=i["inherited_env"],
                    profile=self.profile,
                    profile_name=spec.env_profile,
                    overrides=spec.env_overrides,
                )
            )
        return decisions

    def supervise(self, run_refs: list) -> tuple[Any, ...]:
        """Wait for one call per rank; the first failure raises at once (the others would hang in
        collectives: `launch` tears every rank down, a rank group leaves that to its owner)."""
        spec = self.spec
        self._mark("started")
        rank_of = {ref: r for r, ref in enumerate(run_refs)}
        returns: list[Any] = [None] * len(run_refs)
        failures: list[RankFailure] = []
        pending = list(run_refs)
        self.last_activity = time.monotonic()
        while pending:
            self.stop.check()
            self.pump_output()
            self._tend_spares()
            idle = time.monotonic() - self.last_activity
            # Before any rank has printed (imports, rendezvous), a short --hang-timeout is not enough.
            limit = spec.hang_timeout_s if self.writes_seen else max(spec.hang_timeout_s, STARTUP_GRACE_S)
            if spec.hang_timeout_s and self.sink is not None and idle > limit:
                raise self._hang(idle)
            done, pending = ray.wait(pending, num_returns=1, timeout=0.25)
            if not done:
                continue
            for ref in done:
                self._collect(ref, rank_of[ref], returns, failures)
            if failures:
                # Peers of a dead rank fail a moment later with connection errors: gather what arrives
                # within a short window, so the root cause is the rank that failed first.
                more = (
                    ray.wait(pending, num_returns=len(pending), timeout=ROOT_CAUSE_WINDOW_S)[0]
                    if pending
                    else []
                )
                for ref in more:
                    self._collect(ref, rank_of[ref], returns, failures)
                self.pump_output(wait_s=2.0)  # the failing rank's last lines before the report
                raise RankFailedError(failures, spec.world_size)
        return tuple(returns)

    def _collect(self, ref, rank: int, returns: list, failures: list[RankFailure]) -> None:
        """The rank's return value into `returns`, or its failure into `failures`."""
        info = self.infos[rank]
        where = {
            "rank": rank,
            "node_ip": info["node_ip"],
            "hostname": info["hostname"],
            "gpu": ",".join(info["gpu_ids"]),
        }
        try:
            out = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            failures.append(
                RankFailure(**where, kind="died", summary=_death_summary(e, info), at=time.time())
            )
            return
        except ray.exceptions.RayError as e:
            failures.append(
                RankFailure(
                    **where, kind="exception", summary=_first_line(e), traceback=str(e), at=time.time()
                )
            )
            return
        if out["ok"]:
            returns[rank] = out["value"]
            return
        failures.append(
            RankFailure(
                **where,
                kind=out["kind"],
                summary=out["summary"],
                traceback=out["traceback"],
                exit_code=out["exit_code"],
                at=out["at"],
            )
        )

    def _hang(self, idle_s: float) -> RankFailedError:
        """Every rank's state and stack, read on its node; the failure that ends this attempt."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from .hang import hang_failures, inspect_processes

        log.error("no output or progress from any rank for %.0fs: reading every rank's stack", idle_s)
        by_node: dict[str, list[int]] = {}
        for r, info in enumerate(self.infos):
            by_node.setdefault(info["node_id"], []).append(r)
        task = ray.remote(inspect_processes)
        refs = {
            node: task.options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote([self.infos[r]["pid"] for r in ranks])
            for node, ranks in by_node.items()
        }
        seen: dict[int, dict[str, Any]] = {}
        for node, ref in refs.items():
            try:
                for r, found in zip(by_node[node], ray.get(ref, timeout=60), strict=True):
                    seen[r] = found
            except ray.exceptions.RayError as e:
                log.warning("could not inspect the ranks on node %s: %s", node[:8], _first_line(e))
        if any(str(v.get("how", "")).startswith("faulthandler") for v in seen.values()):
            self.pump_output(wait_s=2.0)  # their stacks reach the rank logs through the sink
        for r in sorted(seen):
            if seen[r].get("stack"):
                log.error("stack of rank %d (pid %s):\n%s", r, seen[r]["pid"], seen[r]["stack"].rstrip())
        ranks = [dataclasses.asdict(r) for r in self.ranks]
        return RankFailedError(hang_failures(idle_s, ranks, seen), self.spec.world_size)

    # -- logging -------------------------------------------------------------------------------
    def _log_topology(self, ranks: tuple[RankInfo, ...], master_addr: str, master_port: int) -> None:
        rows = [("rank", "node", "ip", "host", "local_rank", "gpu", "pid")]
        rows += [
            (
                str(r.rank),
                str(r.node_rank),
                r.node_ip,
                r.hostname,
                str(r.local_rank),
                r.gpu or "-",
                str(r.pid),
            )
            for r in ranks
        ]
        log.info(
            "topology (MASTER_ADDR=%s MASTER_PORT=%d):\n%s",
            master_addr,
            master_port,
            format_table(rows, "  "),
        )

    def _log_env(self, decisions: list[EnvDecision]) -> None:
        first = decisions[0].to_set
        log.info("env of rank 0: %s", " ".join(f"{k}={v}" for k, v in sorted(redact(first).items())))
        notes: dict[str, list[int]] = {}
        for rank, d in enumerate(decisions):
            for note in d.notes:
                notes.setdefault(note, []).append(rank)
        for note, ranks in notes.items():
            log.warning("env on rank(s) %s: %s", format_rank_ranges(ranks), note)

    # -- teardown -------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Kill every rank and remove every group, whatever happened; then release the port. Groups
        handed over with the spares stay, for the next attempt."""
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        if self.spares_in is not None:  # given, but stopped before adopting them
            self.spares_in.kill(groups=True)
            self.spares_in = None
        if self.next_spares is not None and not self.handed_over:
            self.next_spares.kill(groups=False)
        self._finish_output()
        if self.host is None and not self.handed_over:  # a colocated job leaves the groups to their owner
            placement.remove_groups(self.groups)
        if self.port_reserved:
            ports.release(*self.port_reserved)
        self._mark("torn_down")

    def _finish_output(self) -> None:
        """Last lines into the files and onto the console, then stop the sink."""
        if self.drain_ref is not None:
            self.pump_output(wait_s=5.0)  # lines already drained come before what finish() returns
        sink, self.sink = self.sink, None
        if sink is not None:
            with contextlib.suppress(Exception):
                self._show(*ray.get(sink.finish.remote(), timeout=10))
            with contextlib.suppress(Exception):
                ray.kill(sink, no_restart=True)
        if self.progress is not None:
            self.progress.close()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _death_summary(e: ray.exceptions.RayActorError, info: dict[str, Any]) -> str:
    return f"{describe_death(str(e))} (pid {info['pid']})"
