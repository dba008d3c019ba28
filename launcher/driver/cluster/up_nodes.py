"""The `ray start --block` processes of `megaray up` (driver/cluster/up.py): starting one, waiting
for it to be up, and the head's port.

The head's GCS port is picked free, then bound by the GCS a moment later. A port from the kernel's
ephemeral range can be taken meanwhile by any outgoing connection on the machine (Ray's own gRPC
clients open many), and the GCS then exits as it starts ("Failed to start GCS ... Last connection
error: None", seen once in a CI run on a loaded 2-core machine). So the port comes from below that
range and above the ports megaray's launches draw MASTER_PORT from (core/topology.py PORT_RANGE,
itself above Ray's worker ports), where nothing takes a port unasked; and a head whose GCS exited as
it started is started once more, on another port.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ...core.errors import ClusterError
from ...core.topology import PORT_RANGE, candidate_ports
from ...rank.probes import ephemeral_range, port_is_free, start_ticks
from .owned import session_members

log = logging.getLogger("megaray")

NODE_START_TIMEOUT_S = 90.0
# from the end of the launches' MASTER_PORT range to the kernel's ephemeral range (`ip_local_port_range`,
# 32768 by default)
QUIET_PORTS_FROM = PORT_RANGE[1]
# What `ray start --head` says when its GCS process exited before answering (ray/_private/node.py)
GCS_EXITED = "Failed to start GCS"
HEAD_STARTS = 2


def free_port() -> int:
    """A free port outside the ephemeral range (the module's docstring says why), drawn afresh at each
    call (a head started again must not draw the port its GCS could not bind); the kernel's pick where
    that range leaves none below it."""
    low = (ephemeral_range() or (32768, 60999))[0]
    drawn = candidate_ports(secrets.token_hex(8), lo=QUIET_PORTS_FROM, hi=low)
    for port in itertools.islice(drawn, 50):
        if port_is_free(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_command() -> list[str]:
    """The `ray` command of this Python: its script beside the interpreter, as pip installs it, else
    the same entry point through the interpreter (Ray on PYTHONPATH, from a folder or an archive,
    has no script)."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    return [ray_bin] if os.access(ray_bin, os.X_OK) else [sys.executable, "-m", "ray.scripts.scripts"]


def start_node(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [*ray_command(), "start", "--block", "--disable-usage-stats", *args]
    with open(log_path, "a") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def start_head(
    args: list[str], log_path: Path, env: dict[str, str], procs: list[subprocess.Popen],
    start: Callable[[list[str], Path, dict[str, str]], subprocess.Popen] = start_node,
) -> str:  # fmt: skip
    """Start the head on a free port and wait until its GCS answers; its address. The head's
    process is put first in `procs` as soon as it runs, so that an interruption meanwhile stops it.
    A head whose GCS exited as it started is started again, on another port (HEAD_STARTS in all).
    `start`: how a node is started (tests start stand-ins for Ray's head here)."""
    attempt = 1
    while True:
        port = free_port()
        said_before = log_path.stat().st_size if log_path.exists() else 0
        procs.insert(0, start(["--head", "--port", str(port), *args], log_path, env))
        ticks = start_ticks(procs[0].pid)  # our child, not yet reaped: its pid is still its own
        address = f"127.0.0.1:{port}"
        try:
            wait_until(lambda a=address: reachable(a), procs[0], log_path)
            return address
        except ClusterError:
            said = log_path.read_bytes()[said_before:].decode(errors="replace")
            if attempt == HEAD_STARTS or procs[0].poll() is None or GCS_EXITED not in said:
                raise
        head = procs.pop(0)
        for member in session_members(head.pid, ticks):  # what it started before its GCS went
            with contextlib.suppress(ProcessLookupError):
                os.kill(member.pid, signal.SIGKILL)
        log.info("the local Ray's GCS exited as it started on port %d: starting the head again", port)
        attempt += 1


def reachable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def count_alive() -> int:
    import ray

    return sum(n["Alive"] for n in ray.nodes())


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, logs: Path) -> None:
    """Until `ready()`; a ClusterError with the log's last lines if the node's `ray start` ends first
    or it takes NODE_START_TIMEOUT_S."""
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = logs.read_text()[-1500:] if logs.exists() else ""
            raise ClusterError(f"a node of `megaray up` did not start (see {logs}): {tail.strip()[-400:]}")
        time.sleep(0.2)
