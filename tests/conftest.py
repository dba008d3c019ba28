from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# Under pytest-xdist each worker is a machine of its own as far as the tests can tell: its own temp
# dir, so Ray's temp dir (its session_latest and ray_current_cluster), megaray's default runs dir and
# its rank spools are not shared with the tests another worker runs at the same time. Short: Ray's
# socket paths under it must fit in 107 bytes.
_SHARED_TMP = Path(os.environ.get("TMPDIR") or "/tmp")  # the workers' own are under it
if os.environ.get("PYTEST_XDIST_WORKER"):
    _own = _SHARED_TMP / os.environ["PYTEST_XDIST_WORKER"]
    _own.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(_own)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


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

from . import turns  # noqa: E402

_own_group: Path | None = None  # this worker's CPU cgroup (tests/turns.py)


def pytest_configure(config):
    """megaray's own modules compiled once, before any test starts a process: under
    PYTHONDONTWRITEBYTECODE=1 (set on some CI machines, this one's included) no process writes
    `__pycache__`, so each driver, rank and forwarder of the suite compiled the ~70 modules it imports
    afresh (~0.08 CPU-s each, ~500 processes a run). A user's first import writes them; pip compiles
    an installed package at install. Reading them is allowed whatever that variable says."""
    import compileall

    global _own_group
    if hasattr(config, "workerinput"):
        _own_group = turns.join_own_group()
    else:  # the run's first process
        for folder in ("launcher", "tests", "bench", "examples"):
            compileall.compile_dir(REPO / folder, quiet=2, workers=1)


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


# The ports free_port hands out: below Ray's worker ports (10002-19999) and the kernel's ephemeral
# range (32768-60999), above Ray's defaults (6379, 8265) and the namespace cluster's head
# (tests/test_netns.py). A port the kernel picks (bind to 0) is in the ephemeral range, where any
# outgoing connection on the machine (Ray's gRPC clients open many) can take it between the pick and
# the test's Ray binding it, and Ray's GCS then exits as it starts (megaray up hit this: its head
# port now comes from below that range, driver/cluster/up_nodes.py). Each xdist worker draws from a
# share of its own, and never hands out a port twice.
_PORTS = range(8300, 10000)
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port for a test's Ray (its GCS, dashboard, agent), free now and not given out before."""
    import random
    import socket

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = _PORTS[worker % workers :: workers]
    for port in random.sample(share, len(share)):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address, no SO_REUSEADDR: as Ray's GCS checks its port
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port left in {_PORTS.start}-{_PORTS.stop - 1}")


def read_ranks(out: Path, name: str, world: int) -> list[dict]:
    return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(world)]


class _OneNode:
    """The local Ray of `one_node`, while it is up in this process."""

    up = False


def table_names(text: str) -> list[str]:
    """What a Markdown table in `text` names in its rows' first cells, in backticks (`--nodes N`,
    `summary.json`'s fields): the docs' tables that tests/test_docs.py and the launch tests check."""
    cells = [row.split(" | ")[0] for row in text.splitlines() if row.startswith("| `")]
    return [name for cell in cells for name in re.findall(r"`([^`]+)`", cell)]


def documented_fields(file: str) -> set[str]:
    """The fields docs/reference/run-directory.md lists for `file` (`summary.json`, `topology.json`):
    the launch tests check the files they read against them, so a field added or renamed is listed."""
    page = (REPO / "docs" / "reference" / "run-directory.md").read_text()
    return set(table_names(page.split(f"## `{file}`", 1)[1].split("\n## ", 1)[0]))


@pytest.fixture
def one_node():
    """One Ray node started in this process (4 CPUs, 2 GPUs declared), for the modules that call
    `main()` in-process (`launch`); with its dashboard, which the state API that `leftovers` asks
    needs. Started by the first test that asks for it and kept while the next test on this worker
    asks for it too (two modules in a row), stopped before one that does not (pytest_runtest_teardown).
    Entrypoints resolve from the working directory, as torchrun's scripts do."""
    import ray

    os.chdir(REPO)
    if not _OneNode.up:
        with ray_starting():
            ray.init(address="local", num_cpus=4, num_gpus=2, namespace="megaray", include_dashboard=True,
                     dashboard_port=free_port())  # fmt: skip
        _OneNode.up = True
    yield


# Each node's dashboard agent listens on a free port, not on Ray's default (52365): the namespace
# cluster's head (test_netns, started beside this at the run's start) serves jobs on that one, and a
# fresh-clone run's submit failed ("No available agent to submit job") where test_restarts' head took it
# first; a node that finds it taken retries it for ~3.4 s before it registers. (megaray's own local and
# simulated Rays do the same: driver/cluster/rayprivate.py `only_what_one_launch_uses`.)
AGENT_ANY_PORT = {"dashboard_agent_listen_port": 0}


def simulated_cluster(head: dict, nodes: list[dict]):
    """A module's simulated cluster (ray.cluster_utils): a head of 1 CPU and no GPU with its dashboard
    on a port of the suite's (`head` adds to its arguments), then `nodes`, all registered; started
    under `ray_starting`."""
    from ray.cluster_utils import Cluster

    with ray_starting():
        args = {"num_cpus": 1, "num_gpus": 0, "dashboard_port": free_port(), **AGENT_ANY_PORT, **head}
        c = Cluster(initialize_head=True, head_node_args=args)
        for node in nodes:
            c.add_node(**AGENT_ANY_PORT, **node)
        c.wait_for_nodes()
    return c


def ray_starting() -> contextlib.AbstractContextManager[None]:
    """Around a test's own Ray starting (a fixture's cluster): Ray gives a node's raylet 30 s to
    register with its GCS (hard-coded in ray/_private/node.py), and a worker lowered beside another's
    `alone` test that makes the machine busy on purpose took longer (a fresh-clone run of 2026-12-07:
    this fixture's `ray.init` and a `ray start` head, both beside the sixteen-ranks test, which then
    lowered the others; it lowers nobody now). The start waits for any `alone` test to end, not for a
    busy one, and has the cores while it runs, the busy test's worker lowered too
    (turns.others_lowered); inside an `alone` test, which holds the turn already, it just runs."""
    return turns.others_lowered(_own_group, _SHARED_TMP)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield  # the test's own fixtures first
    if _OneNode.up and (nextitem is None or "one_node" not in nextitem.fixturenames):
        import ray

        ray.shutdown()
        _OneNode.up = False
    return result


def launch(job: str, *args: str, out: Path | None = None) -> int:
    """`main()` in this process, as `megaray --job-name JOB ARGS` (on `one_node`); `out`, where the
    tests' targets write what each rank saw (tests/targets.py)."""
    from launcher.cli import main

    env = ["--env", f"MEGARAY_TEST_OUT={out}"] if out else []
    return main(["--job-name", job, "--placement-timeout", "20", *env, *args])


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "out"


# The kinds of test, by module, for `-m` (pyproject.toml lists the markers): `pure` needs no Ray and
# starts no process; `ray` runs a local Ray in the test's process or in the commands it runs;
# `cluster` runs several nodes (simulated with ray.cluster_utils, or real `ray start` processes);
# `netns` three machines in network namespaces; `megatron` needs the megatron extra. `slow` is what
# the fast loop (`pytest -m "not slow"`) leaves out.
KINDS = {
    "test_addresses": ("ray", "slow"),
    "test_bench": ("cluster", "slow"),
    "test_demo": ("ray", "slow"),
    "test_examples": ("ray",),
    "test_gpu_suite": ("pure",),
    "test_megatron": ("megatron",),
    "test_metrics": ("cluster", "slow"),
    "test_multi_node": ("cluster", "slow"),
    "test_netns": ("netns", "slow"),
    "test_one_node": ("ray",),
    "test_rank_failures": ("ray",),
    "test_process": ("ray", "slow"),
    "test_ray_start": ("cluster", "slow"),
    "test_restarts": ("cluster", "slow"),
    "test_submit": ("cluster", "slow"),
    "test_up": ("cluster", "slow"),
}

# Seconds each module took on 2 cores (three runs of 2026-12-07's afternoon, `-p tests.cpu_per_test`):
# pytest-xdist hands whole modules to its workers (`--dist loadfile`, so a module's cluster is started
# once) in this order (`--no-loadscope-reorder`), longest first, so that no long module starts last
# while the other worker sits idle (test_submit, ranked by last week's figures, ran last in one
# worker for the run's last 40 s while the other had nothing left; test_gpu_suite, ranked at 73 s, its
# one CPU test 57-106 s, its last 46 s).
# FIRST go before them all: the namespace cluster's head (../shared/netns/ray-cluster.sh) takes Ray's
# default job-agent and client-server ports (52365, 10001), which any other Ray started on this
# machine with defaults would hold first; beside it run test_ray_start (its clusters take free ports),
# then modules whose Rays start no client server (a Cluster head, a local ray.init: their job agent
# goes without its port, which they do not use) until it is done: not `megaray up` (test_up,
# test_bench), which starts `ray start --head` with the defaults. test_addresses goes first of all:
# most of its time is waiting out bounded connections (13 CPU-s), which costs nothing beside the
# clusters the others start, and left the cores half idle at the run's end; and its tests are `quiet`
# (never beside a busy one): last of FIRST, it started as test_rank_failures reached its two busy
# tests, and its worker sat idle for 40-77 s until they were done (three runs of 2026-12-07).
# Without the namespace tests (the fast loop), longest first alone.
FIRST = (
    "test_addresses", "test_netns", "test_ray_start", "test_restarts", "test_one_node", "test_rank_failures",
)  # fmt: skip
SECONDS = {
    "test_restarts": 295, "test_up": 251, "test_netns": 244, "test_megatron": 220, "test_ray_start": 191,
    "test_bench": 182, "test_process": 167, "test_rank_failures": 149, "test_one_node": 133,
    "test_multi_node": 130, "test_metrics": 112, "test_gpu_suite": 95, "test_demo": 77, "test_submit": 72,
    "test_addresses": 40, "test_examples": 30,
}  # fmt: skip


def _module(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1]


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """The kinds first, for `-m` to select by; the order once selected."""
    for item in items:
        for kind in KINDS.get(_module(item), ("pure",)):
            item.add_marker(kind)
    result = yield
    modules = {_module(item) for item in items}
    first = {module: i for i, module in enumerate(FIRST)} if "test_netns" in modules else {}
    items.sort(key=lambda item: (first.get(_module(item), len(FIRST)), -SECONDS.get(_module(item), 0)))
    return result


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with turns.turn(turn_of(item), _own_group, _SHARED_TMP):
        yield


def turn_of(item) -> turns.Turn:
    """The test's turn, from its markers (pyproject.toml: `alone`, `alone(busy=True)`, `quiet`)."""
    alone = item.get_closest_marker("alone")
    if alone is not None:
        return turns.Turn.BUSY if alone.kwargs.get("busy", False) else turns.Turn.ALONE
    return turns.Turn.QUIET if item.get_closest_marker("quiet") is not None else turns.Turn.SHARED
