"""What megaray's scaling rests on, checked on a one-node Ray (issue #31's assumptions):

- naming an actor costs a synchronous GCS round trip in `.remote()` (so a launch's rank actors are
  unnamed);
- an async actor's calls share one concurrency limit, which pending waits hold: with every slot
  waiting, no other call runs (so the ranks' stop waits, on each node's forwarder, have a group of
  their own);
- the placement group table is one call for every group (so placement reads it once, not per group).

    python bench/ray_assumptions.py --actors 300 --groups 32

The last line is machine-readable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import ray
from common import local_ray, median
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group


def actor_creation(n: int, repeats: int) -> dict[str, float]:
    """Milliseconds per `.remote()` of an actor that is never scheduled (so no process starts)."""

    @ray.remote(num_cpus=0, resources={"nowhere": 1})
    class Unplaceable:
        pass

    ms: dict[str, list[float]] = {"unnamed": [], "named": []}
    for k in range(repeats):
        for kind in ("unnamed", "named"):
            t0 = time.perf_counter()
            actors = [
                Unplaceable.options(name=f"assume-{k}-{i}" if kind == "named" else None).remote()
                for i in range(n)
            ]
            ms[kind].append((time.perf_counter() - t0) * 1000 / n)
            for a in actors:
                ray.kill(a)
    return {kind: median(v) for kind, v in ms.items()}


def held_by_waits(slots: int) -> dict[str, bool]:
    """Whether a call runs while `slots` waits are pending, with the waits in the default group or
    in a group of their own."""

    class Waiter:  # defined here, so that it is sent by value: the workers cannot import bench/
        def __init__(self):
            self.event: asyncio.Event | None = None

        async def wait(self) -> None:
            self.event = self.event or asyncio.Event()
            await self.event.wait()

        @ray.method(concurrency_group="control")
        async def wait_in_group(self) -> None:
            self.event = self.event or asyncio.Event()
            await self.event.wait()

        async def ping(self) -> str:
            return "pong"

    out = {}
    plain = ray.remote(concurrency_groups={"control": 1})(Waiter).options(max_concurrency=slots).remote()
    _started(plain)
    waits = [plain.wait.remote() for _ in range(slots)]
    time.sleep(1)
    out["default group"] = _pong(plain)
    grouped = (
        ray.remote(concurrency_groups={"control": slots + 1})(Waiter).options(max_concurrency=slots).remote()
    )
    _started(grouped)
    waits += [grouped.wait_in_group.remote() for _ in range(slots)]
    time.sleep(1)
    out["own group"] = _pong(grouped)
    for a in (plain, grouped):
        ray.kill(a)
    return out


def _started(actor) -> None:
    """The actor up before its calls are sent: its worker process can take more than the 3 s a ping
    is given on a busy machine (a CI run's own tests beside it), which read as held when it was not."""
    ray.get(actor.__ray_ready__.remote(), timeout=120)


def _pong(actor) -> bool:
    """Whether a call to `actor` answered within 3 s (an error, such as the actor failing to start,
    is not an answer)."""
    ref = actor.ping.remote()
    return bool(ray.wait([ref], timeout=3)[0]) and ray.get(ref) == "pong"


def group_table(n: int, repeats: int) -> dict[str, float]:
    """Milliseconds to read the node of `n` placement groups: a call per group, or one for all."""
    groups = [placement_group([{"CPU": 0.001}], strategy="STRICT_PACK") for _ in range(n)]
    ray.get([g.ready() for g in groups], timeout=60)
    per, once = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        [placement_group_table(g)["bundles_to_node_id"][0] for g in groups]
        per.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        table = placement_group_table()
        [table[g.id.hex()]["bundles_to_node_id"][0] for g in groups]
        once.append((time.perf_counter() - t0) * 1000)
    for g in groups:
        remove_placement_group(g)
    return {"per group": median(per), "one read": median(once)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, default=300)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slots", type=int, default=4, help="the waiter's concurrency limit")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    started = not ray.is_initialized()
    if started:
        local_ray(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        created = actor_creation(args.actors, args.repeats)
        held = held_by_waits(args.slots)
        table = group_table(args.groups, args.repeats)
    finally:
        if started:
            ray.shutdown()
    print(
        f"actor .remote(): unnamed {created['unnamed']:.2f} ms, named {created['named']:.2f} ms "
        f"({args.actors} actors, median of {args.repeats})"
    )
    print(
        f"a call while {args.slots} waits hold an async actor's {args.slots} slots: "
        f"{'runs' if held['default group'] else 'does not run (3 s)'}; with the waits in their own "
        f"group: {'runs' if held['own group'] else 'does not run (3 s)'}"
    )
    print(
        f"nodes of {args.groups} placement groups: {table['per group']:.1f} ms a call each, "
        f"{table['one read']:.1f} ms one read"
    )
    print(f"unnamed_ms={created['unnamed']:.2f} named_ms={created['named']:.2f} "
          f"default_group_runs={int(held['default group'])} own_group_runs={int(held['own group'])} "
          f"table_per_group_ms={table['per group']:.1f} table_once_ms={table['one read']:.1f}")  # fmt: skip
    return {"created": created, "held": held, "table": table}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
