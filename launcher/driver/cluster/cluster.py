"""Getting a Ray cluster: attach to one, start a local one, or simulate several nodes for a dry run."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray

from ...core.errors import ClusterError, UsageError
from ...core.rankenv import redact_argv
from ...core.spec import RAY_NAMESPACE, LaunchSpec
from ...core.topology import RankReport, local_gpus_problem, local_ranks_problem
from ...core.versions import python_version
from ...rank.serialization import serializers_when_imported
from ..lifecycle.registry import runner_for
from ..output.held_stderr import HeldStderr
from . import rayprivate, up
from .auth import AUTH_HINT, token_mode
from .nodeenv import node_environment
from .reach import check_reachable

log = logging.getLogger("megaray")
# Attaching takes about a second once the GCS has answered (driver/cluster/reach.py); past this, it hangs.
CONNECT_TIMEOUT_S = 10.0


@dataclass
class Cluster:
    """The cluster a launch runs on. `fixed_size` is True for clusters this process started: no
    autoscaler can add nodes to them, so a layout that does not fit fails at once instead of waiting."""

    address: str
    fixed_size: bool
    up_address: str | None = None  # the `megaray up` Ray it is, which `megaray down` may stop meanwhile


def _caused_by_auth(e: BaseException | None) -> bool:
    """Ray wraps a rejected token in connection errors: look down the chain."""
    while e is not None:
        if type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _command_line() -> list[str]:
    """This process's command line, as Ray would record it (`/proc/self/cmdline`: the interpreter,
    the script, every argument), else `sys.argv`."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return [sys.executable, *sys.argv]


def _init(**kwargs: Any) -> None:
    from ray.exceptions import AuthenticationError

    address = kwargs.get("address")
    try:
        with rayprivate.entrypoint_shown_as(redact_argv(_command_line())):
            ray.init(namespace=RAY_NAMESPACE, logging_level=logging.WARNING, **kwargs)
    except (AuthenticationError, ConnectionError, RuntimeError) as e:
        if _caused_by_auth(e):
            raise ClusterError(f"the Ray cluster at {address} {AUTH_HINT}") from None
        if isinstance(e, ConnectionError):
            raise ClusterError(
                f"cannot connect to Ray at {address}: {str(e).splitlines()[0]}; fix --address or RAY_ADDRESS"
            ) from None
        if "version mismatch" in str(e).lower():
            raise ClusterError(
                f"{str(e).splitlines()[0]}; install the cluster's Ray and Python versions in the driver"
            ) from None
        raise


# Ray's words when the raylet it started did not register with the GCS within 30 s (ray/_private/node.py)
RAY_START_TIMED_OUT = "The current node timed out during startup"


def start_timed_out(load: float, cores: int, temp_dir: str) -> str:
    """The one line for a local Ray whose raylet did not register in Ray's 30 s: on a machine busy
    past its cores its agents' Python starts take that long (seen on 2 cores beside the test suite),
    else its logs say why."""
    busy = f"this machine is busy (load {load:.1f} on {cores} core(s)): " if load > cores else ""
    return (
        f"the local Ray did not start: its node did not come up within Ray's 30 s; {busy}"
        f"try again, or attach to a running cluster with --address (Ray's logs: "
        f"{temp_dir}/session_latest/logs)"
    )


@contextlib.contextmanager
def _started_in_time() -> Iterator[None]:
    """Around starting a Ray here (local, or a simulated cluster's nodes): Ray's bare Exception for a
    node that did not come up, as one line (Ray has stopped what it started by then)."""
    try:
        yield
    except Exception as e:
        if not str(e).startswith(RAY_START_TIMED_OUT):
            raise
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        raise ClusterError(start_timed_out(load, cores, rayprivate.temp_dir())) from None


@contextlib.contextmanager
def connect(
    spec: LaunchSpec,
    *,
    exits_after: bool = False,
    hold_interrupts: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
) -> Iterator[Cluster]:
    """Yield a connected cluster; disconnect (and stop what we started) afterwards.

    `hold_interrupts`: around starting a Ray here (a local one, a simulated cluster), so that a
    Ctrl-C is acted on once the start has returned (driver/lifecycle/stop.py `EarlyInterrupt.held`).

    `exits_after`: the process ends the moment the command returns (cli/main.py `entry`), so a
    connection to a cluster megaray did not start is not shut down first (about 0.25 s in Ray's core
    worker; the GCS sees the driver go all the same), and a connection that stalls ends the process.

    An existing connection in this process (tests, notebooks) is used as it is and kept.
    """
    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        yield Cluster(address=ctx.gcs_address, fixed_size=False)
        return
    serializers_when_imported()  # before this process's serialization context is built
    sim = None
    attached = True  # to a cluster megaray did not start for this run
    # A launch collects its ranks' output itself (driver/output/relay.py): Ray's own streaming would only add
    # its raylet and autoscaler chatter (and a warning for every rank stopped by SIGTERM) to the
    # console. A rank group has no sink and relies on it.
    streams = not runner_for(spec.target).relays_output
    stack = contextlib.ExitStack()
    try:
        if spec.address:
            ours = (standing := up.running()) is not None and standing.address == spec.address
            _attach(stack, spec.address, streams, exits_after, announce=not ours)
            mine = spec.address if ours else None
            cluster = Cluster(address=spec.address, fixed_size=False, up_address=mine)
        elif (standing := up.running()) is not None:
            log.info(
                "attaching to the local Ray of `megaray up` at %s (`megaray down` stops it)",
                standing.describe(),
            )
            _attach(stack, standing.address, streams, exits_after, announce=False)
            cluster = Cluster(address=standing.address, fixed_size=True, up_address=standing.address)
        elif problem := _local_problem(spec):
            raise UsageError(problem)
        elif spec.dry_run or (spec.nodes > 1 and not spec.uses_gpus):
            # the exact launch a cluster will get, its nodes simulated here: NODE_RANK, GROUP_RANK and
            # cross-node collectives over gloo can be tried on a laptop
            attached = False
            with (
                node_environment(),
                rayprivate.only_what_one_launch_uses(log_monitor=streams),
                _started_in_time(),
                hold_interrupts(),
            ):
                sim = _simulate(spec)
            _init(address=sim.address, log_to_driver=streams)
            cluster = Cluster(address=sim.address, fixed_size=True)
        else:
            # "local": a private Ray for this run, even when `ray start` left one on this machine, with
            # a logical CPU for every rank (torchrun starts 4 ranks on 2 cores too); its real GPUs
            log.info("starting a local Ray for this run (attach to a running cluster with --address)")
            attached = False
            cpus = max(os.cpu_count() or 1, math.ceil(spec.world_size * spec.cpus_per_rank))
            # Ray's own line that it turned token authentication on for a local Ray (and made a token
            # in ~/.ray/auth_token where none was): a Ray private to this run, stopped after it
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
                logging.ERROR
            )
            with (
                node_environment(),
                rayprivate.only_what_one_launch_uses(log_monitor=streams),
                _started_in_time(),
                hold_interrupts(),
            ):
                _init(address="local", include_dashboard=False, num_cpus=cpus, log_to_driver=streams,
                      _system_config=rayprivate.RUN_RAY_CONFIG)  # fmt: skip
            cluster = Cluster(address=ray.get_runtime_context().gcs_address, fixed_size=True)
        quiet_raylet(not streams)
        yield cluster
    finally:
        quiet_raylet(False)
        # Ray's driver shutdown waits about 0.25 s in its core worker; when the process ends right
        # after the command, the GCS sees the driver go all the same (a Ray we started is stopped).
        if ray.is_initialized() and not (attached and exits_after):
            if not attached and sim is None:  # the local Ray started above
                rayprivate.stop_monitor()
            ray.shutdown()
        stack.close()
        if sim is not None:
            stop_simulated(sim)


def _local_problem(spec: LaunchSpec) -> str | None:
    """Why the launch's ranks cannot run on a Ray started on this machine, said before starting one:
    CPU ranks past what its cores take, or more GPU ranks than it has GPUs. A dry run's ranks are CPU
    processes here whatever GPUs its simulated nodes declare (`--nodes 1:<huge>` started raylets one
    by one)."""
    if not spec.uses_gpus or spec.dry_run:
        return local_ranks_problem(spec.world_size, os.cpu_count() or 1)
    return local_gpus_problem(spec.world_size, rayprivate.local_gpu_count())


def connect_timeout_s() -> float:
    """The bound on attaching to a cluster once its GCS answered (MEGARAY_CONNECT_TIMEOUT_S)."""
    raw = os.environ.get("MEGARAY_CONNECT_TIMEOUT_S", "")
    try:
        value = float(raw) if raw else CONNECT_TIMEOUT_S
    except ValueError:
        value = CONNECT_TIMEOUT_S
    return value if math.isfinite(value) and value > 0 else CONNECT_TIMEOUT_S


def _attach(
    stack: contextlib.ExitStack, address: str, streams: bool, exits_after: bool, announce: bool = True
) -> None:
    """Attach to the cluster at `address`: its GCS asked first, in seconds (driver/cluster/reach.py), then
    `ray.init` under a deadline, since Ray's own connection retries for minutes whatever it meets."""
    first = check_reachable(address)
    stack.enter_context(token_mode(address, first, announce))
    with deadline(connect_timeout_s(), address, exits_after):
        _init(address=address, log_to_driver=streams)


@contextlib.contextmanager
def deadline(seconds: float, address: str, exits_after: bool = False) -> Iterator[None]:
    """Bound a call that Ray may hold for minutes (its GCS client blocks in C++, where neither a
    signal handler nor an exception reaches it). At the deadline the command (cli/main.py `entry`)
    ends with exit 2 and one line: nothing is placed yet, so nothing is left. Called from Python
    (notebooks, tests), the process is not ended: the line is logged and the call goes on.

    What Ray writes to stderr meanwhile is held back and shown when the call returns: its C++
    client's retry warnings (`Failed to connect to GCS ... within 5 seconds`) would otherwise come
    before the one line, which says more."""
    done = threading.Event()
    held = HeldStderr()

    def watch() -> None:
        if done.wait(seconds):
            return
        held.release(drop=True)
        message = (
            f"the Ray cluster at {address} answered, then did not finish letting this driver in within "
            f"{seconds:.0f} s (a GCS that stalled or is overloaded, or a Ray of another version): check "
            "the head (`ray status` there), or raise MEGARAY_CONNECT_TIMEOUT_S"
        )
        log.error("%s", message)
        if exits_after:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(2)

    watcher = threading.Thread(target=watch, name="megaray-connect-deadline", daemon=True)
    held.hold()
    watcher.start()
    try:
        yield
    finally:
        done.set()
        held.release()


def quiet_raylet(on: bool) -> None:
    """Keep Ray's "(raylet) A worker died or was killed..." paragraphs, one per rank, off the console
    of a launch we connected for: the failure report names the rank, its host, its signal and its last
    output, and those paragraphs would bury it (Ray prints them even with log_to_driver off). The
    switch is the one Ray's own debugger uses to quiet worker output."""
    rayprivate.show_worker_logs(not on)


# A simulated node beside the head writes its logs where the head's do (one machine, one session):
# the head's log monitor tails them all, a second one would tail the same files again (a share of a
# core each, and every line published twice), as `ray start` says of one log monitor per machine.
SIMULATED_NODE = {"include_log_monitor": False}


def _simulate(spec: LaunchSpec):
    """N local raylets with declared GPUs: the whole multi-node path on one machine."""
    from ray.cluster_utils import Cluster as RayCluster

    per_node = {
        "num_cpus": max(1, int(spec.cpus_per_rank * spec.gpus_per_node + 0.999)),
        "num_gpus": spec.gpus_per_node if spec.uses_gpus else 0,
    }
    log.info(
        "simulating %d node(s) x %d %s on this machine",
        spec.nodes,
        spec.gpus_per_node,
        "declared GPUs" if spec.uses_gpus else "CPU ranks",
    )
    logging.getLogger("ray._private.utils").setLevel(logging.WARNING)  # "Overwriting previous Ray address"
    sim = RayCluster(initialize_head=True, head_node_args={**per_node, "include_dashboard": False})
    for _ in range(spec.nodes - 1):
        sim.add_node(**per_node, **SIMULATED_NODE)
    sim.wait_for_nodes()
    return sim


def stop_simulated(sim: Any) -> None:
    """Ray's `Cluster.shutdown`, its head's autoscaler monitor killed first (rayprivate.stop_monitor:
    a second of every simulated launch's end); the benches' and tests' clusters stop with it too."""
    if sim.head_node is not None:
        rayprivate.stop_monitor(sim.head_node)
    sim.shutdown()


def check_versions(reports: list[RankReport]) -> None:
    """Every rank's node must run the driver's Ray and Python (pickled code and wire formats differ)."""
    want = (ray.__version__, python_version())
    bad = {}
    for r in reports:
        got = (r.ray_version, r.python_version)
        if got != want:
            bad[f"{r.node_ip} ({r.hostname})"] = got
    if bad:
        nodes = "; ".join(f"{n}: Ray {r}, Python {p}" for n, (r, p) in sorted(bad.items()))
        raise ClusterError(
            f"node versions differ from the driver's (Ray {want[0]}, Python {want[1]}): {nodes}; "
            "install the same Ray and Python on every node and the driver"
        )
