"""A pool across launches (`megaray up`, `megaray up --warm`; `--warm --address` on a cluster): one
rank process per slot of a layout, already started by Ray, in placement groups it holds. A warm pool's
processes have torch (and megatron-core where installed) imported, CUDA not initialised; the pool of a
plain `megaray up` has imported nothing (a Ray worker's start is about a CPU-second on a small machine,
the launch's largest cost after the imports, and those stay the program's own).

Warm spares (gang/spares.py) do this within a job, for a restart; the pool does it for the next launch.
A launch whose layout is the pool's claims it (the first to ask gets it), gives each process its
rank and env as any rank gets them, and runs the program there as torchrun would (`__main__`,
argv, cwd; the program's own modules are imported fresh, since only torch and the launcher's stack
were imported ahead). The processes and groups are detached: they outlive the launch that made them.
After a launch took the pool, the next starts in the background (a warm pool, not a recipe's, with
what that launch's ranks imported ahead). An idle pool gives its bundles back after `--idle-timeout`.

The layout is recorded in the cluster's own key-value store (the GCS), not on the machine that
asked for it: every driver attached to that cluster finds the same pool, and a launch on another
cluster never touches it."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import asdict, dataclass, replace

import ray

from ...core.errors import UsageError
from ...core.recipes import load_recipe
from ...core.spec import RAY_NAMESPACE, LaunchSpec
from ...core.target import DRY_RUN_TARGET, Target, TargetKind
from ...core.topology import RankReport, RankSlot, assign_ranks, order_nodes
from ..gang import placement
from ..gang.actors import first_line, start_rank_actor, wait_all
from ..lifecycle.registry import runner_for
from ..lifecycle.stop import StopSignal
from . import rayprivate

log = logging.getLogger("megaray")

POOL = "megaray-pool"
SINK = f"{POOL}-sink-"  # + the node id: the output sink started ahead on the node of the driver that filled
TAKEN = "megaray-pool-taken"  # the job that took the pool now there: a claim every driver sees at once
LEARNED = "megaray-pool-imports"  # what the last launch's ranks imported ahead: a warm pool's refills'
POOL_READY_S = 120.0  # a pool still importing (just refilled) is waited for this long, then skipped
POOL_PLACED_S = 10.0  # a refilled pool's groups are waited for this long, then given back


@dataclass(frozen=True)
class PoolLayout:
    nodes: int
    gpus_per_node: int
    device: str
    cpus_per_rank: float = 1.0
    idle_timeout_s: float = 1800.0
    fixed_size: bool = True  # the cluster cannot grow (a local Ray): placement fails at once
    warm: bool = True  # torch (and megatron) imported ahead; else the processes are only started
    # `megaray up --warm --recipe NAME`: Megatron-Bridge and the recipe's module imported ahead too,
    # CUDA still untouched (rank/warmup.py), so that a GPU launch of a recipe skips bridge's import
    recipe: str | None = None

    def __post_init__(self):
        """Checked before any Ray starts (`megaray up --cpus-per-rank -1` started the nodes, then failed
        with a traceback): the launch's own rules, then the idle timeout."""
        try:
            _spec(self)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if self.recipe is not None and not self.warm:
            raise UsageError("--recipe is what a warm pool imports ahead: add --warm")
        if self.recipe is not None:
            load_recipe(self.recipe)  # an unknown one is bad input, said now
        if not self.idle_timeout_s >= 0:  # nan included
            raise UsageError(f"--idle-timeout must be at least 0 (0: never), got {self.idle_timeout_s}")

    def describe(self) -> str:
        unit = "GPUs" if self.device == "gpu" else "CPU ranks"
        return f"{self.nodes} node(s) x {self.gpus_per_node} {unit}"

    @property
    def holds(self) -> str:
        if self.recipe is not None:
            return f"with Megatron-Bridge and recipe {self.recipe} imported"
        return "with torch imported" if self.warm else "started, nothing imported"

    @property
    def imports(self) -> tuple[str, ...]:
        """What each process imports ahead: the dry run's stack (megatron-core's skipped where it is
        absent), or the recipe's (bridge's)."""
        if not self.warm:
            return ()
        target = DRY_RUN_TARGET
        if self.recipe is not None:
            target = Target(TargetKind.MEGATRON, self.recipe, recipe=load_recipe(self.recipe))
        return runner_for(target).warm_imports(target)

    @property
    def kind(self) -> str:
        return "warm pool" if self.warm else "pool"

    def fits(self, spec: LaunchSpec) -> bool:
        return (spec.nodes, spec.gpus_per_node, spec.device) == (
            self.nodes, self.gpus_per_node, self.device
        ) and spec.cpus_per_rank <= self.cpus_per_rank  # fmt: skip


def recorded() -> PoolLayout | None:
    """The connected cluster's pool, if one was asked for there (and not dropped)."""
    raw = rayprivate.kv_get(POOL, namespace=RAY_NAMESPACE)
    return PoolLayout(**json.loads(raw)) if raw else None


def keep(layout: PoolLayout) -> None:
    """Record the pool on the connected cluster and fill it, waiting until its processes imported."""
    old = recorded()
    if old is not None and old != layout:
        give_back(old)
    _record(layout)
    rayprivate.kv_del(LEARNED, namespace=RAY_NAMESPACE)  # a new pool imports what it was asked for
    if len(_groups(layout)) < layout.nodes:
        give_back(layout)  # a part left of an earlier one
        fill(layout, wait=True)


def drop() -> PoolLayout | None:
    """Forget the connected cluster's pool, then give it back; what it was.

    Forgotten first: giving it back ends the ranks of a launch that took it, and that launch, ending,
    refills a pool still recorded (`refill`), starting the processes `down` is giving back, on a Ray
    that `megaray down` is stopping meanwhile (the driver then hung in Ray's actor creation until
    Ray's client ended it, a minute later, without its report)."""
    layout = recorded()
    if layout is None:
        return None
    rayprivate.kv_del(POOL, namespace=RAY_NAMESPACE)
    rayprivate.kv_del(LEARNED, namespace=RAY_NAMESPACE)
    try:
        give_back(layout)
    except BaseException:  # recorded again, so that the next `down` finds what it has to give back
        _record(layout)
        raise
    return layout


def _record(layout: PoolLayout) -> None:
    rayprivate.kv_put(POOL, json.dumps(asdict(layout)), overwrite=True, namespace=RAY_NAMESPACE)


def _spec(layout: PoolLayout) -> LaunchSpec:
    return LaunchSpec(
        nodes=layout.nodes, gpus_per_node=layout.gpus_per_node, target=DRY_RUN_TARGET, dry_run=True,
        device=layout.device, cpus_per_rank=layout.cpus_per_rank, job_name=POOL,
    )  # fmt: skip


def fill(layout: PoolLayout, wait: bool) -> None:
    """Place the pool's groups (detached) and start one process per bundle (importing, when warm)."""
    spec = _spec(layout)
    if wait or layout.nodes > 1:
        groups = placement.place_groups(spec, POOL, StopSignal(), fixed_size=layout.fixed_size, detached=True)
    else:  # a refill at the end of a launch: one group has no node to keep apart from, so it is not
        # waited for (the raylet frees the launch's bundles a moment after), and the command ends now
        groups = placement.create_groups(spec, POOL, detached=True)
    rayprivate.kv_del(TAKEN, namespace=RAY_NAMESPACE)  # a new pool, not taken yet
    # what ranks get, before torch loads; nothing when nothing is imported (setup gives the whole env)
    env = {"OMP_NUM_THREADS": "1"} if layout.gpus_per_node > 1 and layout.warm else {}
    imports = _imports(layout)
    idle = layout.idle_timeout_s
    actors = [
        start_rank_actor(
            f"{POOL}-g{g}b{b}", group, b, job=POOL, rank=g * layout.gpus_per_node + b, node_ip="",
            num_cpus=spec.cpus_per_rank, num_gpus=1 if spec.uses_gpus else 0,
            pooled={"env": env, "steps": imports, "group": f"{POOL}-node{g}", "idle_timeout_s": idle,
                    "sinks": SINK},
        )
        for g, group in enumerate(groups)
        for b in range(layout.gpus_per_node)
    ]  # fmt: skip
    _start_sink()
    if wait:
        ray.get([a.info.remote() for a in actors], timeout=POOL_READY_S)


def _imports(layout: PoolLayout) -> tuple[str, ...]:
    """What the pool's processes import: what the last launch imported ahead (`refill`), else what
    the layout asks for."""
    learned = rayprivate.kv_get(LEARNED, namespace=RAY_NAMESPACE) if layout.warm else None
    return tuple(json.loads(learned)) if learned else layout.imports


def _start_sink() -> None:
    """A launch's output sink, started ahead on this driver's node (where the next launch's driver
    most likely runs: it is used there only), its Ray worker's start off the next launch's path; it
    ends with the pool's group 0 unless a launch took it."""
    from ..output.relay import start_sink

    try:  # the name is still held by the last one: the next launch starts its own
        start_sink(SINK + ray.get_runtime_context().get_node_id(), True).remote(pool_group=POOL + "-node0")
    except Exception as e:
        log.debug("no output sink started ahead: %s", e)


def _stop_sinks(keep: str = "") -> object | None:
    """Stop the pool's output sinks but the one named `keep`, whose handle is returned if it runs."""
    kept = None
    for name in ray.util.list_named_actors():
        if name.startswith(SINK):
            with contextlib.suppress(ValueError):
                actor = ray.get_actor(name, namespace=RAY_NAMESPACE)
                if name == keep:
                    kept = actor
                else:
                    ray.kill(actor, no_restart=True)
    return kept


@dataclass(frozen=True)
class Taken:
    groups: list
    slots: list[RankSlot]
    actors: list
    reports: list[RankReport]
    sink: object | None  # the output sink started ahead on this driver's node


def take(spec: LaunchSpec, stop: StopSignal, start_env: dict[str, str] | None = None) -> Taken | None:
    """The pool's processes for this launch, in rank order, or None (no pool, another layout, start-up
    variables its processes did not start with, or another launch took it): then the launch starts
    cold."""
    layout = recorded()
    if layout is None:
        return None
    groups = _groups(layout)
    claim = _claim()
    if claim is not None and groups and not claim.ended():  # a launch runs in it: never give it back
        log.info("the %s is in use by job %s: this launch starts cold", layout.kind, claim.job)
        return None
    if claim is not None and groups:  # its launch ended without giving it back (its driver was killed)
        give_back(layout)  # which stops what that launch's ranks still ran in it
        rayprivate.kv_del(TAKEN, namespace=RAY_NAMESPACE)
        log.info(
            "the %s was taken by job %s, which ended without giving it back: given back (this launch "
            "starts cold and refills it)", layout.kind, claim.job,
        )  # fmt: skip
        return None
    if not layout.fits(spec):
        if give_back(layout):
            log.info(
                "the %s is for %s: given back for this launch's layout, which starts cold",
                layout.kind, layout.describe(),
            )  # fmt: skip
        return None
    if start_env:
        if give_back(layout):  # its processes started without them; the launch needs the room
            log.info(
                "this launch sets start-up variables (%s), which the %s's processes did not start with: "
                "given back, and this launch's rank processes start afresh with them",
                ", ".join(start_env), layout.kind,
            )  # fmt: skip
        return None
    # refilled at the end of the last launch without waiting: placed once the raylet freed that
    # launch's bundles (a moment); never placed when another job holds them
    if len(wait_all([g.ready() for g in groups], POOL_PLACED_S, stop)) < len(groups):
        give_back(layout)  # it holds nothing yet; this launch places its own, and refills after
        log.info("the %s was not placed within %g s: this launch starts cold", layout.kind, POOL_PLACED_S)
        return None
    by_bundle = _actors(layout)
    if by_bundle is None or len(groups) < layout.nodes:
        give_back(layout)  # a part of it, if any: this launch needs the room
        log.info(
            "the %s is not there (given back when idle, or in use): this launch starts cold", layout.kind
        )
        return None
    mine = Claim(spec.job_name, ray.get_runtime_context().get_job_id())
    if rayprivate.kv_put(TAKEN, json.dumps(asdict(mine)), overwrite=False, namespace=RAY_NAMESPACE):
        other = _claim()
        log.info("the %s is in use by job %s: this launch starts cold", layout.kind, other and other.job)
        return None
    claims = [a.claim.remote(spec.job_name) for a in by_bundle.values()]
    try:
        if len(wait_all(claims, POOL_READY_S, stop)) < len(claims) or not all(ray.get(claims)):
            rayprivate.kv_del(TAKEN, namespace=RAY_NAMESPACE)  # the next launch may find it ready
            log.info(
                "the %s is still starting, or another launch took it: this launch starts cold", layout.kind
            )
            return None
        slots = assign_ranks(order_nodes(placement.resolve_nodes(groups)), spec.gpus_per_node)
        actors = [by_bundle[(slot.group, slot.bundle)] for slot in slots]
        reports = ray.get([a.info.remote() for a in actors], timeout=POOL_READY_S)
    except (ray.exceptions.RayError, ValueError) as e:  # a process of it is gone: its node was lost
        give_back(layout)
        rayprivate.kv_del(TAKEN, namespace=RAY_NAMESPACE)
        log.info(
            "the %s has lost a process (%s): given back, this launch starts cold",
            layout.kind, first_line(e),
        )  # fmt: skip
        return None
    log.info("taking the %s (%d processes %s)", layout.kind, len(actors), layout.holds)
    return Taken(
        groups, slots, actors, [replace(r, rank=sl.rank) for r, sl in zip(reports, slots, strict=True)],
        _stop_sinks(keep=SINK + ray.get_runtime_context().get_node_id()),  # the one on this driver's node
    )  # fmt: skip


def _actors(layout: PoolLayout) -> dict[tuple[int, int], object] | None:
    """The pool's processes by (group, bundle), or None when one is gone."""
    try:
        return {
            (g, b): ray.get_actor(f"{POOL}-g{g}b{b}", namespace=RAY_NAMESPACE)
            for g in range(layout.nodes)
            for b in range(layout.gpus_per_node)
        }
    except ValueError:
        return None


def _groups(layout: PoolLayout) -> list:
    """The pool's placement groups that exist, by node."""
    found = []
    for i in range(layout.nodes):
        with contextlib.suppress(ValueError):
            found.append(ray.util.get_placement_group(f"{POOL}-node{i}"))
    return found


def give_back(layout: PoolLayout) -> bool:
    """Remove the pool's groups (which ends its processes) and its sinks; whether there were groups."""
    placement.remove_groups(groups := _groups(layout))
    _stop_sinks()
    return bool(groups)


def refill(imported: tuple[str, ...] = ()) -> None:
    """At the end of a launch on a cluster with a pool recorded and not there (taken, given back for
    another layout, or idle): the next one, started in the background (it is detached).

    `imported`: what this launch's ranks imported ahead (its runner's warm imports). A warm pool asked
    for without a recipe refills with that: the launches a pool serves are most often the same
    program again, and the dry run's megatron-core, imported ahead for a plain torch script, would
    cost every process seconds of CPU beside the next launch and its memory for nothing. A pool of a
    recipe keeps importing the recipe's stack (what `--recipe` asked for)."""
    layout = recorded()
    if layout is None or len(_groups(layout)) == layout.nodes:
        return
    if imported and layout.warm and layout.recipe is None:
        rayprivate.kv_put(LEARNED, json.dumps(list(imported)), overwrite=True, namespace=RAY_NAMESPACE)
    if waiting := placement.groups_waiting(but=POOL):  # the room this launch freed is theirs first
        log.info(
            "a launch is waiting for room (placement group %s): the %s is not refilled now; the launch "
            "after it refills it", waiting[0], layout.kind,
        )  # fmt: skip
        return
    try:
        fill(layout, wait=False)
    except Exception as e:  # the next launch starts cold, and says so
        log.warning("could not refill the warm pool: %s", str(e).splitlines()[0])


@dataclass(frozen=True)
class Claim:
    """Who took the pool: the launch's job name, and its driver's Ray job, by which a claim whose
    launch is gone is told from one in use (a driver killed with SIGKILL gives nothing back)."""

    job: str
    ray_job: str  # hex id

    def ended(self) -> bool:
        if not self.ray_job:
            return False  # an older megaray's claim: its driver cannot be told; in use, as before
        dead = rayprivate.job_is_dead(self.ray_job)  # Ray's job table: its driver's connection closed
        return True if dead is None else dead  # None: not a job of this cluster (any more)


def _claim() -> Claim | None:
    raw = rayprivate.kv_get(TAKEN, namespace=RAY_NAMESPACE)
    try:
        return Claim(**json.loads(raw)) if raw else None
    except (ValueError, TypeError):  # written by an older megaray: the job's name only
        return Claim(raw.decode(errors="replace"), "")


def state(layout: PoolLayout) -> str:
    """For `megaray list`: ready, in use, importing (starting), or given back."""
    groups, actors = _groups(layout), _actors(layout)
    if not groups:
        return "given back (idle, or taken and not refilled yet): the next launch refills it"
    if (claim := _claim()) is not None:
        if claim.ended():
            return (
                f"taken by job {claim.job}, which ended without giving it back: the next launch gives it back"
            )
        return f"in use by job {claim.job}"
    if actors is None or len(groups) < layout.nodes:
        return f"incomplete ({len(groups)} of {layout.nodes} group(s)): the next launch replaces it"
    refs = [a.info.remote() for a in actors.values()]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0)
    if len(ready) < len(refs):
        doing = "importing" if layout.warm else "starting"
        return f"{doing}: {len(ready)} of {len(refs)} process(es) ready"
    return f"ready: {len(refs)} process(es) {layout.holds}"
