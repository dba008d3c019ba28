"""Shared by the benchmarks (and a test or two): timing commands, a real `ray start` head, summary
statistics, a process slowed from outside."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


_starting: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext


def start_ray_with(starting: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
    """Around every Ray a bench starts from here on, `starting` (tests/test_bench.py: the suite's
    `ray_starting`). Ray gives a node's raylet 30 s to register with its GCS, a bound hard-coded in
    ray/_private/node.py; the suite runs these benches beside its other tests, which a test that
    times ranks can lower to a quarter of the CPU (a fresh-clone CI run of 2026-12-07 failed so in
    bench/failures.py's head). A bench run by hand has the machine and needs nothing."""
    global _starting
    _starting = starting


# Each node's dashboard agent on a free port, not Ray's default (52365), which another Ray of this
# machine may hold (a node that finds it taken retries it ~3.4 s before it registers) or need (a
# cluster that serves jobs there): as megaray's own simulated nodes (driver/cluster/rayprivate.py)
AGENT_ANY_PORT = {"dashboard_agent_listen_port": 0}


def simulated_cluster(head: dict, nodes: list[dict]):
    """A `ray.cluster_utils.Cluster`: its head (`head`, its arguments), then `nodes`, all registered;
    started as `start_ray_with` asked."""
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    with _starting():
        cluster = Cluster(initialize_head=True, head_node_args={**AGENT_ANY_PORT, **head})
        for node in nodes:
            cluster.add_node(**AGENT_ANY_PORT, **node)
        cluster.wait_for_nodes()
    return cluster


def local_ray(**init_args) -> None:
    """`ray.init(address="local", ...)`, started as `start_ray_with` asked."""
    import ray

    with _starting():
        ray.init(address="local", **init_args)


@contextlib.contextmanager
def ray_cluster(nodes: int, cpus_per_node: int, gpus_per_node: int = 0) -> Iterator[str]:
    """A running Ray cluster of `nodes` simulated nodes (the first is the head), stopped afterwards;
    yields its address. Only its own processes are stopped, never another Ray on the machine."""
    from launcher.driver.cluster.cluster import SIMULATED_NODE

    args = {"num_cpus": cpus_per_node, "num_gpus": gpus_per_node}
    others = [{**args, **SIMULATED_NODE}] * (nodes - 1)
    cluster = simulated_cluster({**args, "include_dashboard": False}, others)
    try:
        yield cluster.address
    finally:
        stop_cluster(cluster)


def quiet_port() -> int:
    """A free port for a bench's own Ray (its dashboard), from below the kernel's ephemeral range as
    `megaray up` draws its head's (launcher/driver/cluster/up_nodes.py `free_port`): a port the kernel
    picks (bind to 0, close, hand on) can be taken by any outgoing connection on the machine before
    the dashboard binds it (tests/test_bench.py runs these benches beside the suite's other Rays)."""
    if str(REPO) not in sys.path:  # a bench run as `python bench/<name>.py`
        sys.path.append(str(REPO))
    from launcher.driver.cluster.up_nodes import free_port

    return free_port()


def stop_cluster(cluster) -> None:
    """`Cluster.shutdown`, its head's autoscaler monitor killed first, as megaray stops the Rays it
    starts (launcher/driver/cluster/rayprivate.py `stop_monitor`: a second saved)."""
    if str(REPO) not in sys.path:  # a bench run as `python bench/<name>.py`
        sys.path.append(str(REPO))
    from launcher.driver.cluster.cluster import stop_simulated

    stop_simulated(cluster)


def timed(cmd: list[str], timeout: float = 600) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    return t0, p


QUOTA_PERIOD_S = 0.01  # shorter than any step it slows: each is slowed alike (see `throttle`)


def throttle(pid: int, until: threading.Event, busy_s: float = 0.015, stopped_s: float = 0.045) -> None:
    """Process `pid` made 4x slower from outside, as a slower or shared device would make a rank:
    allowed `busy_s` of every `busy_s + stopped_s` until `until` is set (and always let go).

    Where its CPU cgroup can take a child (root, cgroup v1's `cpu` controller), the kernel holds it
    to that share of one CPU (`cpu.cfs_quota_us`), exact whatever the load, in periods of
    QUOTA_PERIOD_S: a rank that had waited in a collective for longer than a period starts its next
    forward step with the period's whole quota, and a 12 ms step that fits in one of 60 ms ran at full
    speed (a dry-run rank measured 2.0x its peers, not 4x, named, un-named and named again). Elsewhere
    it is stopped and continued by signals from this thread, which a loaded machine wakes late: the
    rank then runs longer than `busy_s` between stops, and a 13 ms forward step mostly fitted between
    them (once measured 1.97x its peers, not 4x, with three test workers on 2 cores)."""
    with contextlib.suppress(ProcessLookupError):
        share = busy_s / (busy_s + stopped_s)
        with _cpu_quota(pid, share * QUOTA_PERIOD_S, QUOTA_PERIOD_S) as held:
            if held:
                until.wait()
                return
        try:
            while not until.is_set():
                os.kill(pid, signal.SIGSTOP)
                time.sleep(stopped_s)
                os.kill(pid, signal.SIGCONT)
                time.sleep(busy_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def _cpu_quota(pid: int, busy_s: float, period_s: float) -> Iterator[bool]:
    """`pid` in a child of its cgroup v1 `cpu` group with a quota of `busy_s` per `period_s`, moved
    back and the child removed afterwards; yields False where no such group could be made. The
    controller may share its hierarchy (`cpu,cpuacct`, as systemd mounts it: /sys/fs/cgroup/cpu is
    then a link to it)."""
    try:
        path = next(line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                    if "cpu" in line.split(":", 2)[1].split(","))  # fmt: skip
    except (OSError, StopIteration):
        yield False
        return
    parent = Path("/sys/fs/cgroup/cpu") / path.strip().lstrip("/")
    child = parent / f"megaray-throttle-{pid}"
    try:
        child.mkdir()
    except OSError:
        yield False
        return
    try:
        (child / "cpu.cfs_period_us").write_text(str(round(period_s * 1e6)))
        (child / "cpu.cfs_quota_us").write_text(str(round(busy_s * 1e6)))
        (child / "cgroup.procs").write_text(str(pid))
    except OSError:
        child.rmdir()
        yield False
        return
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):  # ended meanwhile: nothing to move
            (parent / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            child.rmdir()
