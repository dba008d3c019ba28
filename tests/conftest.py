from __future__ import annotations

import json
import os
import time
from pathlib import Path

# Ray reads this when imported; the launcher sets it too, but tests import ray first.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest

REPO = Path(__file__).resolve().parent.parent


def leftovers(job: str, wait_s: float = 10.0) -> tuple[list[str], list[str]]:
    """Actors and placement groups of `job` still alive; polls while Ray finishes removing them."""
    import ray
    from ray.util.state import list_actors

    deadline = time.monotonic() + wait_s
    while True:
        actors = [
            a.name
            for a in list_actors(filters=[("state", "!=", "DEAD")], limit=10000)
            if (a.name or "").startswith(job + "-")
        ]
        groups = [
            g["name"]
            for g in ray.util.placement_group_table().values()
            if g["name"].startswith(job + "-") and g["state"] != "REMOVED"
        ]
        if (not actors and not groups) or time.monotonic() > deadline:
            return actors, groups
        time.sleep(0.2)


def read_ranks(out: Path, name: str, world: int) -> list[dict]:
    return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "out"
