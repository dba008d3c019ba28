"""Every call megaray makes into Ray's private or experimental APIs, in one place, each with the
reason no public API serves (as megatron/compat.py does for Megatron). A Ray upgrade that moves one
breaks here, and tests/test_structure.py keeps the rest of the package off them."""

from __future__ import annotations

import contextlib
import subprocess
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
# The `_system_config` of the Ray megaray starts on this machine for one run (`ray.init(address="local")`,
# driver/cluster/cluster.py), which declares a logical CPU for every core (at least one a rank). By
# default a raylet starts one idle Python worker per core for the first driver that connects, and that
# driver's `ray.init` returns only once they have all registered (Ray's worker pool: the first job's
# driver waits for min(CPUs, cores) prestarted workers): on a 96-core GPU node, 96 Python processes
# before an 8-rank launch places anything, 87 of them idle for the whole run. megaray starts the
# actors it needs (the ranks, the output sink) as it needs them: Ray starts their workers then. On 2
# cores with Ray deciding as for 16 (2 ranks, 2026-12-07): the program started at 4.3 s instead of 7.3,
# 5.8 CPU-s against 13.3; on 2 cores as they are, the same either way. A key Ray no longer knows makes
# its GCS exit as it starts (`ray.init` fails after its timeout): tests/test_structure.py checks the
# key against the installed Ray.
RUN_RAY_CONFIG = {"prestart_worker_first_driver": False}


@contextlib.contextmanager
def only_what_one_launch_uses(*, log_monitor: bool) -> Iterator[None]:
    """A Ray started in this process for one launch (`ray.init(address="local")`, a simulated
    cluster's nodes) without the head's processes such a Ray has no use for: the autoscaler's monitor
    (nothing to scale: `stop_monitor` killed it at the end before), the API server (with
    `include_dashboard=False` it loads Ray's usage-stats reporter alone; megaray asks a Ray it started
    nothing through it), and, unless `log_monitor`, the log monitor (a launch that collects its ranks'
    output itself never reads what it tails from every worker's log files). Each is a Python process
    whose start shares the cores with the raylet's and the ranks' (on 2 cores, a 2-rank launch's
    7.2 CPU-s came to 5.0-5.5 without the three), and the log monitor polls while the ranks run.

    And its dashboard agent listens on any free port, not on Ray's default (52365): where another Ray
    runs on the machine (a `ray start` cluster, a notebook's Ray) and holds it, the agent tried it six
    times over 3.4 s before it gave its HTTP server up, and the launch took 8 s instead of 4.

    And whether the dashboard's libraries are installed (the agent starts `--minimal` where not) is
    asked without importing them (`dashboard_libraries_missing`).

    `ray.init` passes none of these options to its node. Should an upgrade move these methods, Ray
    starts them as before."""
    try:
        import ray._private.utils as ray_utils
        from ray._private.node import Node
        from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT
    except ImportError:  # pragma: no cover - a Ray without it starts as it always did
        yield
        return
    names = ["start_monitor", "start_api_server", *(() if log_monitor else ("start_log_monitor",))]
    own = {name: getattr(Node, name, None) for name in names}
    if None in own.values():  # pragma: no cover - the same
        yield
        return
    own_init = Node.__init__

    def init(node: Any, ray_params: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(ray_params, "dashboard_agent_listen_port", None) == DEFAULT_DASHBOARD_AGENT_LISTEN_PORT:
            ray_params.dashboard_agent_listen_port = 0  # any free one: Ray's own choice for a port of 0
        own_init(node, ray_params, *args, **kwargs)

    own_check = getattr(ray_utils, "get_dashboard_dependency_error", None)
    for name in names:
        setattr(Node, name, lambda node, **_: None)
    Node.__init__ = init
    if own_check is not None:
        ray_utils.get_dashboard_dependency_error = dashboard_libraries_missing
    try:
        yield
    finally:
        for name, method in own.items():
            setattr(Node, name, method)
        Node.__init__ = own_init
        if own_check is not None:
            ray_utils.get_dashboard_dependency_error = own_check


# What `ray.dashboard.optional_deps` imports (Ray 2.60): Ray's own check imports them all
DASHBOARD_LIBRARIES = (
    "aiohttp", "aiohttp_cors", "grpc", "opencensus", "opentelemetry.exporter.prometheus",
    "opentelemetry.proto", "prometheus_client", "pydantic",
)  # fmt: skip


def dashboard_libraries_missing() -> ImportError | None:
    """Ray's `get_dashboard_dependency_error`, answered by finding the libraries instead of importing
    them. Ray asks it as it starts a node's raylet (the dashboard agent starts `--minimal` without
    them), in the process that starts the node: importing aiohttp, grpc, OpenTelemetry and pydantic
    took 0.19 s of a launch's driver, and pydantic's import then had Ray's serializers for it and
    Arrow registered (rank/serialization.py), importing pyarrow, 0.2 s more, both on the way to the
    ranks' start (2026-12-06, 2 cores). Nothing in the driver uses them."""
    from importlib.util import find_spec

    for name in DASHBOARD_LIBRARIES:
        try:
            found = find_spec(name) is not None
        except ImportError as e:  # a parent package that is not there
            return e
        if not found:
            return ModuleNotFoundError(f"No module named {name!r}", name=name)
    return None


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
