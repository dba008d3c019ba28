"""A rank group for the single-controller pattern: place and start one actor per rank once, then
call functions on every rank many times (RL loops, sweeps, notebooks), and free it all at the end.

The actors carry the same env contract and GPU mapping as a launch, so a function can join the
process group from the env as any rank of `launch` would.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...core.errors import RankFailedError
from ...core.profiles import load_profile
from ...core.rankenv import check_user_env
from ...core.shellenv import forwarded_env
from ...core.spec import DEFAULT_PLACEMENT_TIMEOUT_S, LaunchSpec, default_job_name
from ...core.target import GROUP_TARGET
from ...core.topology import RankInfo
from ..cluster.cluster import connect
from ..lifecycle.stop import StopSignal
from ..supervision.supervise import supervise
from .gang import RankGang
from .sources import PlaceRequest


def _release(gang: RankGang, stack: contextlib.ExitStack) -> None:
    try:
        gang.teardown()
    finally:
        stack.close()


class RankGroup:
    """`RankGroup(nodes=2, gpus_per_node=8)`; then `run_all`, `run_each`; then `shutdown()`.

    Dropping the object, or the interpreter exiting, frees the actors and placement groups too.
    """

    def __init__(
        self,
        nodes: int = 1,
        gpus_per_node: int = 1,
        *,
        device: str = "gpu",
        cpus_per_rank: float = 1.0,
        address: str | None = None,
        env: Mapping[str, str] | None = None,
        env_profile: str | None = None,
        job_name: str | None = None,
        placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S,
        gpu_share: float = 1.0,
        colocate_with: RankGroup | None = None,
    ):
        """`gpu_share` < 1 leaves room on each rank's GPU (and its CPUs) for another group created
        with `colocate_with=this_group`: its ranks then run on exactly the same GPUs, rank for rank
        (a trainer and a generator taking turns). Shut the colocated group down first."""
        check_user_env(env or {}, "env")
        if not 0 < gpu_share <= 1:
            raise ValueError(f"gpu_share must be within (0, 1], got {gpu_share}")
        if colocate_with is not None:
            host = colocate_with.spec
            if (host.nodes, host.gpus_per_node) != (nodes, gpus_per_node):
                raise ValueError(
                    f"a colocated group has the layout of its host: {host.nodes} x {host.gpus_per_node}, "
                    f"got {nodes} x {gpus_per_node}"
                )
            free = 1.0 - colocate_with._shares_used
            if gpu_share > free + 1e-9:
                raise ValueError(f"gpu_share {gpu_share} exceeds the {free:g} left on the host group's GPUs")
            address, device, cpus_per_rank = host.address, host.device, host.cpus_per_rank
        self.spec = LaunchSpec(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            target=GROUP_TARGET,
            device=device,
            cpus_per_rank=cpus_per_rank,
            address=address,
            job_name=job_name or default_job_name(),
            placement_timeout_s=placement_timeout_s,
            env_profile=env_profile,
            env=tuple((env or {}).items()),
            forwarded=tuple(forwarded_env(os.environ).items()),
        )
        profile = load_profile(env_profile) if env_profile else {}
        stack = contextlib.ExitStack()
        cluster = stack.enter_context(connect(self.spec))
        self._stop = StopSignal()
        self._gang = RankGang(
            self.spec,
            self._stop,
            profile,
            PlaceRequest(self.spec.job_name, fixed_size=cluster.fixed_size),
            gpu_share=gpu_share,
            host=colocate_with._gang if colocate_with is not None else None,
        )
        self._shares_used = gpu_share
        try:
            self._gang.place()
            self._gang.start()
        except BaseException:
            _release(self._gang, stack)
            raise
        if colocate_with is not None:
            colocate_with._shares_used += gpu_share
        self._finalizer = weakref.finalize(self, _release, self._gang, stack)

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def ranks(self) -> tuple[RankInfo, ...]:
        return self._gang.ranks

    @property
    def actors(self) -> list:
        return list(self._gang.actors)

    def run_all(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`fn(*args, **kwargs)` on every rank; the results by rank. A failing rank raises
        RankFailedError (the group stays; call `shutdown()` if a rank died)."""
        refs = self._gang.call(fn, [args] * self.world_size, kwargs)
        return list(self._supervise(refs))

    def run_each(self, fn: Callable[[Any], Any], items: Sequence[Any], *, group_size: int = 1) -> list[Any]:
        """`fn(item)` with one item per `group_size` consecutive ranks (a tensor-parallel group when
        TP = group_size): each rank of a group gets the same item, and only the group's first rank's
        result is returned, one per item."""
        world = self.world_size
        if group_size < 1 or world % group_size or len(items) != world // group_size:
            raise ValueError(
                f"run_each needs world size {world} / group size {group_size} = "
                f"{world // max(group_size, 1)} items, got {len(items)}"
            )
        refs = self._gang.call(fn, [(items[r // group_size],) for r in range(world)], {})
        results = self._supervise(refs)
        return [results[r] for r in range(0, world, group_size)]

    def _supervise(self, refs: list) -> tuple:
        try:
            return supervise(self._gang.ends, refs, self._stop)
        except RankFailedError as e:
            e.ending = (
                "The rank group is still up, its other ranks untouched: call shutdown() if a rank died."
            )
            raise

    def shutdown(self) -> None:
        """Kill every rank and remove every placement group (idempotent)."""
        self._finalizer()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *_exc) -> None:
        self.shutdown()
