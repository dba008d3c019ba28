"""Every call megaray makes into Ray's private or experimental APIs, in one place, each with the
reason no public API serves (as megatron/compat.py does for Megatron). A Ray upgrade that moves one
breaks here, and tests/test_structure.py keeps the rest of the package off them."""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Iterator
from typing import Any


# -- what a Ray started here would declare ------------------------------------------------------------
def local_gpu_count() -> int:
    """The GPUs a Ray started on this machine would declare, by Ray's own detection (its GPU
    accelerator manager: CUDA_VISIBLE_DEVICES, the driver's NVML): asked before starting one, so that
    a GPU launch on a machine without them is refused in a second, not after Ray's start and a
    placement wait. Ray has no public call for it."""
    from ray._private.accelerators import get_accelerator_manager_for_resource

    return int(get_accelerator_manager_for_resource("GPU").get_current_node_num_accelerators() or 0)


# -- starting a Ray here ------------------------------------------------------------------------------
@contextlib.contextmanager
def api_server_beside_raylet() -> Iterator[None]:
    """A Ray started in this process (`ray.init(address="local")`, a simulated cluster's head) starts
    its API server and waits for it to publish its address before it starts the raylet, which then
    waits for its own agents: one Python process's start after another. Here the wait for the API
    server runs in a thread while the raylet starts, and `ray.init` still returns only after both.

    The API server of a Ray started with `include_dashboard=False` loads one module (usage stats);
    nothing asks for its address before the raylet is up (the raylet's `--webui`, which is empty
    with include_dashboard=False anyway, is not known yet then). Measured on 2 cores: `ray.init`
    6.4-6.9 s -> 5.5-6.7 s; on a GPU node's 16 cores the API server's start (1.2-2.5 s) comes off
    the path whole. Ray has no option to order or skip its head processes. Should an upgrade move
    these methods, Ray starts as before. A full dashboard (`include_dashboard=True`, the tests'
    clusters) is started in Ray's order: started beside the raylet, its state API did not answer
    after `ray.init` returned (tried on 2 cores)."""
    try:
        from ray._private.node import Node
        from ray._private.utils import get_dashboard_dependency_error
    except ImportError:  # pragma: no cover - a Ray without it starts as it always did
        yield
        return
    own_api = getattr(Node, "start_api_server", None)
    own_processes = getattr(Node, "start_ray_processes", None)
    if own_api is None or own_processes is None:  # pragma: no cover - the same
        yield
        return
    starting: dict[int, tuple[threading.Thread, list[BaseException]]] = {}

    def start_api_server(node: Any, **kwargs: Any) -> None:
        # Ray decides whether its install is minimal (no dashboard modules) by importing them: once
        # for the API server, once for the raylet's agent command. Asked in two threads at once, the
        # second import can find the first's module half made and take the install for a full one;
        # the agent, started without `--minimal`, dies on its first missing import and the raylet
        # never registers (seen on a GPU node with aiohttp but not aiohttp_cors). Asked here first,
        # both later answers are the same.
        get_dashboard_dependency_error()
        if kwargs.get("include_dashboard"):  # the full dashboard keeps Ray's order (see above)
            own_api(node, **kwargs)
            return
        failed: list[BaseException] = []

        def start() -> None:
            try:
                own_api(node, **kwargs)
            except BaseException as e:  # raised where Ray would have raised it: after the raylet
                failed.append(e)

        t = threading.Thread(target=start, name="megaray-ray-api-server", daemon=True)
        starting[id(node)] = (t, failed)
        t.start()

    def start_ray_processes(node: Any) -> None:
        try:
            own_processes(node)
        finally:
            if (entry := starting.pop(id(node), None)) is not None:
                entry[0].join()
                if entry[1]:
                    raise entry[1][0]

    Node.start_api_server, Node.start_ray_processes = start_api_server, start_ray_processes
    try:
        yield
    finally:
        Node.start_api_server, Node.start_ray_processes = own_api, own_processes


@contextlib.contextmanager
def without_monitors(*, log_monitor: bool) -> Iterator[None]:
    """A Ray started in this process for one launch (`ray.init(address="local")`) without the head's
    autoscaler monitor, and without its log monitor unless `log_monitor`: a Ray private to one launch
    has nothing to scale (`stop_monitor` killed it at the end already), and a launch that collects its
    ranks' output itself has no use for Ray's tailing of every worker's log files. Each is a Python
    process whose start shares the cores with the raylet's and the ranks' (1.2-1.5 CPU-s of a 2-rank
    launch's 7.2 on 2 cores, measured together), and the log monitor keeps polling while the ranks run.
    `ray.init` passes neither option to its node (a simulated cluster's head takes them as arguments:
    cluster.py `_simulate`). Should an upgrade move these methods, Ray starts them as before."""
    try:
        from ray._private.node import Node
    except ImportError:  # pragma: no cover - a Ray without it starts as it always did
        yield
        return
    own_monitor = getattr(Node, "start_monitor", None)
    own_log_monitor = getattr(Node, "start_log_monitor", None)
    if own_monitor is None or own_log_monitor is None:  # pragma: no cover - the same
        yield
        return
    Node.start_monitor = lambda node: None
    if not log_monitor:
        Node.start_log_monitor = lambda node: None
    try:
        yield
    finally:
        Node.start_monitor, Node.start_log_monitor = own_monitor, own_log_monitor


# -- what Ray's job table shows of this driver ----------------------------------------------------
@contextlib.contextmanager
def entrypoint_shown_as(argv: list[str]) -> Iterator[None]:
    """`ray.init` inside records this process's command line as the job's entrypoint, which `ray list
    jobs --detail` and the dashboard show to anyone with access to the cluster; here it records
    `argv` instead (the command line with its secrets redacted). Ray reads it through
    `ray._private.utils.get_entrypoint_name` and has no option to set it."""
    import ray._private.utils as ray_utils

    own = ray_utils.get_entrypoint_name
    ray_utils.get_entrypoint_name = lambda: subprocess.list2cmdline(argv)
    try:
        yield
    finally:
        ray_utils.get_entrypoint_name = own


# -- the GCS key-value store --------------------------------------------------------------------------
# Shared state every driver of a cluster sees at once, with an atomic put-if-absent (a port
# reserved, the pool's layout, who took the pool). Ray has no public key-value store; its own
# libraries (Serve, Tune, the autoscaler) use this one.
def kv_get(key: str, namespace: str | None = None) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=namespace)


def kv_put(key: str, value: str, *, overwrite: bool, namespace: str) -> bool:
    """Whether the key existed already (with overwrite=False, then nothing was written)."""
    from ray.experimental import internal_kv

    return bool(internal_kv._internal_kv_put(key, value, overwrite=overwrite, namespace=namespace))


def kv_del(key: str, namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=namespace)


def autoscaling_status() -> bytes | None:
    """What the head's monitor writes of the autoscaler (to tell a cluster that cannot grow)."""
    return kv_get("__autoscaling_status")


# -- the GCS's tables ---------------------------------------------------------------------------------
# Resources per node and the job table: `ray.available_resources()` sums the whole cluster, and the
# state API (`ray.util.state`) needs the dashboard, which `megaray up` does not start.
def total_resources_per_node() -> dict[str, dict[str, float]]:
    import ray._private.state

    return ray._private.state.total_resources_per_node()


def available_resources_per_node() -> dict[str, dict[str, float]]:
    import ray._private.state

    return ray._private.state.available_resources_per_node()


def job_is_dead(job_id_hex: str) -> bool | None:
    """Whether the driver's job `job_id_hex` has ended (its connection closed); None: no such job."""
    import ray._private.state

    for entry in ray._private.state.jobs():
        if entry["JobID"] == job_id_hex:
            return bool(entry["IsDead"])
    return None


def drivers_running() -> list[tuple[str, int, str]]:
    """(job id, pid, entrypoint) of each driver connected now: the GCS's job table, which a Ray
    without a dashboard (`megaray up`'s) has too, where `ray.util.state.list_jobs` asks the dashboard."""
    import ray._private.state

    return [
        (entry["JobID"], entry["DriverPid"], entry["Entrypoint"])
        for entry in ray._private.state.jobs()
        if not entry["IsDead"]
    ]


# -- the process's own Ray ----------------------------------------------------------------------------
def reload_config() -> None:
    """Have Ray read its settings from the environment again (RAY_AUTH_MODE): it reads them once, at
    import; `ray start` turns token mode on the same way."""
    from ray._raylet import Config

    Config.initialize("")


def show_worker_logs(on: bool) -> None:
    """Ray's "(raylet) A worker died..." paragraphs on this driver's console; the switch Ray's own
    debugger uses to quiet worker output (no public one)."""
    import ray._private.worker as ray_worker

    ray_worker._worker_logs_enabled = on


def temp_dir() -> str:
    """Where a Ray started here keeps its sessions (RAY_TMPDIR, else TMPDIR, else /tmp, then `ray`):
    for the failure line of a local Ray that did not start, whose node never recorded its own."""
    from ray._common.utils import get_default_ray_temp_dir

    return get_default_ray_temp_dir()


def last_cluster_address() -> Any:
    """The cluster `ray start` last started on this machine, as Ray's job client finds it."""
    from ray._private.utils import read_ray_address

    return read_ray_address()


def stop_monitor(node: Any = None) -> None:
    """Kill the autoscaler's monitor of a Ray megaray started (`node`: a simulated cluster's head,
    else this process's own Ray), before that Ray is stopped: a stop asks each of its processes in turn
    to end and gives each up to a second, and the monitor alone takes it all (1.02 s of a 1.18 s
    `ray.shutdown()` here; the raylet 0.06 s, the GCS 0.02 s), a second at the end of every launch on
    such a Ray and of its exit on SIGTERM (#45). A Ray private to one launch has nothing to scale.
    Neither `ray.shutdown` nor `Cluster.shutdown` takes an option for it. It runs on the way out of a
    launch, before the stop: should a Ray upgrade move it, the stop is a second slower, not skipped."""
    import ray._private.worker as ray_worker
    from ray._private import ray_constants

    node = node if node is not None else ray_worker._global_node
    if node is not None:
        with contextlib.suppress(Exception):
            monitor = ray_constants.PROCESS_TYPE_MONITOR
            node._kill_process_type(monitor, check_alive=False, allow_graceful=False)
