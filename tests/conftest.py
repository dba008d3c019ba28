from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def make_hf_cache(root: Path) -> Path:
    """An HF hub cache holding the fixture configs, as `huggingface_hub` lays one out."""
    for model in (FIXTURES / "hf").iterdir():
        if not (model / "config.json").is_file():
            continue
        repo = root / "hub" / f"models--{model.name}"
        revision_file = model / "revision"
        commit = revision_file.read_text().strip() if revision_file.exists() else "0" * 40
        (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        shutil.copy(model / "config.json", repo / "snapshots" / commit / "config.json")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return root


# Set before anything imports huggingface_hub (it reads these once): tests never touch the network,
# and recipes that fetch HF configs find the fixtures. Ray reads RAY_DEDUP_LOGS when imported.
os.environ["HF_HOME"] = str(make_hf_cache(Path(tempfile.mkdtemp(prefix="megaray-hf-"))))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402


def leftovers(job: str, wait_s: float = 10.0) -> tuple[list[str], list[str]]:
    """Actors and placement groups of `job` still alive; polls while Ray finishes removing them."""
    import ray
    from ray.util.state import list_actors

    deadline = time.monotonic() + wait_s
    while True:
        # rank actors are unnamed: theirs are the job's groups (kept in the table once removed)
        ids = {
            g["placement_group_id"]
            for g in ray.util.placement_group_table().values()
            if g["name"].startswith(job + "-")
        }
        actors = [
            a.name or a.repr_name or a.actor_id
            for a in list_actors(
                address=connected(), filters=[("state", "!=", "DEAD")], limit=10000, detail=True
            )
            if (a.name or "").startswith(job + "-") or a.placement_group_id in ids
        ]
        groups = [
            g["name"]
            for g in ray.util.placement_group_table().values()
            if g["name"].startswith(job + "-") and g["state"] != "REMOVED"
        ]
        if (not actors and not groups) or time.monotonic() > deadline:
            return actors, groups
        time.sleep(0.2)


def connected() -> str:
    """The address of the cluster this process is connected to: state-API calls without one go to
    whatever cluster Ray's temp dir names last (a `ray start` long gone, or another test's)."""
    import ray

    return ray.get_runtime_context().gcs_address


def free_port() -> int:
    """A port for a test's Ray dashboard, so tests run beside any other Ray on the machine."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_ranks(out: Path, name: str, world: int) -> list[dict]:
    return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "out"
