"""`megaray up` / `megaray down`: a local Ray that outlives one launch.

A launch with no address starts a Ray for itself and stops it after (3-4 s of every launch on a
laptop, more on 2 cores); developers launch, read the error, fix, launch again. `megaray up` starts
the same local cluster (simulated nodes, as the local launch makes them) as `ray start --block`
processes in the background, one per node, and records them in a state file; launches with no
`--address` and no `RAY_ADDRESS` attach to it; `megaray down` stops them by pid (each `ray start
--block` stops its raylet and workers on SIGTERM) and leaves nothing running. Never `ray stop`: it
would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ClusterError, UsageError
from ..core.raytoken import auth_disabled, find_token, token_path
from ..rank.probes import process_state

log = logging.getLogger("megaray")

NODE_START_TIMEOUT_S = 90.0


def state_dir() -> Path:
    """Private to this user: the state file and the cluster's Ray temp dir (short, for Ray's sockets)."""
    d = Path(os.environ.get("MEGARAY_STATE_DIR") or Path(tempfile.gettempdir()) / f"megaray-{os.getuid()}")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


@dataclass(frozen=True)
class Standing:
    """A running `megaray up`: where it is, what it holds, and the processes that make it."""

    address: str  # HOST:PORT of its GCS
    nodes: int
    gpus_per_node: int
    device: str
    pids: tuple[int, ...]  # the `ray start --block` processes, head first
    temp_dir: str
    started_at: float
    cpus_per_rank: float = 1.0

    def describe(self) -> str:
        unit = "GPUs" if self.device == "gpu" else "CPU ranks"
        return f"{self.address} ({self.nodes} node(s) x {self.gpus_per_node} {unit})"


def _path() -> Path:
    return state_dir() / "up.json"


def _alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z")  # a zombie is not running


def running() -> Standing | None:
    """The `megaray up` cluster if its head is alive; a stale state file is removed."""
    path = _path()
    try:
        data = json.loads(path.read_text())
        state = Standing(**{**data, "pids": tuple(data["pids"])})
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if _alive(state.pids[0]):
        return state
    with contextlib.suppress(OSError):
        path.unlink()
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray_bin, "start", "--block", "--disable-usage-stats", *args]
    with open(log_path, "a") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def start(
    nodes: int, gpus_per_node: int, device: str, cpus_per_rank: float = 1.0,
    when_ready: Callable[[], None] | None = None,
) -> Standing:  # fmt: skip
    """Start the cluster and wait until every node has registered; then, still connected, call
    `when_ready` (which starts a warm pool, driver/pool.py)."""
    import ray

    from ..core.spec import RAY_NAMESPACE as NAMESPACE
    from .auth import token_mode
    from .nodeenv import node_env

    root = state_dir()
    temp_dir = root / "ray"
    port = _free_port()
    cpus = max(1, int(cpus_per_rank * gpus_per_node + 0.999))
    gpus = gpus_per_node if device == "gpu" else 0
    env = node_env(os.environ)
    env.pop("RAY_ADDRESS", None)
    # Ray 2.60's default for a new head; a worker joining by address needs it said
    env.setdefault("RAY_AUTH_MODE", "token")
    if not auth_disabled(env):
        ensure_token(env, Path.home())
    per_node = ["--num-cpus", str(cpus), "--num-gpus", str(gpus)]
    logs = root / "up.log"
    procs = [
        _start_node(
            ["--head", "--port", str(port), "--node-ip-address", "127.0.0.1", "--include-dashboard", "false",
             "--temp-dir", str(temp_dir), *per_node],
            logs, env,
        )
    ]  # fmt: skip
    address = f"127.0.0.1:{port}"
    state = Standing(
        address, nodes, gpus_per_node, device, (procs[0].pid,), str(temp_dir), time.time(), cpus_per_rank
    )
    try:
        _wait(lambda: _reachable(address), procs[0], logs)
        with token_mode(address, announce=False):
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
            try:
                for _ in range(nodes - 1):  # one at a time: raylets registering together time out on 2 cores
                    before = _count_alive()
                    procs.append(_start_node(["--address", address, *per_node], logs, env))
                    _wait(lambda b=before: _count_alive() > b, procs[-1], logs)
                state = dataclasses.replace(state, pids=tuple(p.pid for p in procs))
                if when_ready is not None:
                    when_ready()
            finally:
                ray.shutdown()
    except BaseException:
        stop(dataclasses.replace(state, pids=tuple(p.pid for p in procs)))
        raise
    state = dataclasses.replace(state, pids=tuple(p.pid for p in procs))
    _path().write_text(json.dumps(dataclasses.asdict(state)))
    os.chmod(_path(), 0o600)
    return state


def ensure_token(environ: dict[str, str], home: Path) -> None:
    """The token the nodes start with, in token mode. On a machine where none exists yet (a fresh
    `HOME`), make one where Ray looks for it (~/.ray/auth_token), as Ray's documentation says for
    local development (`ray get-auth-token --generate`) and as a local `ray.init()` does itself; `ray
    status` and the job client find it there too. A RAY_AUTH_TOKEN_PATH naming no token is the user's
    to fix: a token there may be meant to be another cluster's."""
    if find_token(environ, home) is not None:
        return
    path = token_path(environ, home)
    if environ.get("RAY_AUTH_TOKEN_PATH"):
        raise UsageError(
            f"RAY_AUTH_TOKEN_PATH names {path}, which holds no token: write the token there, or unset it "
            "(megaray up then makes one in ~/.ray/auth_token, as `ray get-auth-token --generate` does)"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return  # made a moment ago by another process (an empty file is Ray's to refuse)
    except OSError as e:
        raise UsageError(
            f"no Ray token here, and none can be made in {path} ({e.strerror or e}): set RAY_AUTH_TOKEN, "
            "or RAY_AUTH_TOKEN_PATH to a file holding one, or run with a writable HOME"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what Ray's own generator makes: 256 random bits
    log.info(
        "no Ray token on this machine yet: made one in %s, as `ray get-auth-token --generate` does (the "
        "local Ray of `megaray up` uses token authentication, as Ray's own local clusters do)",
        path,
    )


def _reachable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def _count_alive() -> int:
    import ray

    return sum(n["Alive"] for n in ray.nodes())


def _wait(ready, proc: subprocess.Popen, logs: Path) -> None:
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = logs.read_text()[-1500:] if logs.exists() else ""
            raise ClusterError(f"a node of `megaray up` did not start (see {logs}): {tail.strip()[-400:]}")
        time.sleep(0.2)


def stop(state: Standing, wait_s: float = 30.0) -> list[int]:
    """SIGTERM each node's `ray start --block` (workers first), then SIGKILL its process group if it
    is still there after `wait_s`. Returns the pids that had to be killed."""
    killed = []
    for pid in reversed(state.pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    for pid in reversed(state.pids):
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
    killed += _sweep(state.temp_dir)
    with contextlib.suppress(OSError):
        _path().unlink()
    return killed


def _sweep(temp_dir: str, grace_s: float = 10.0) -> list[int]:
    """Any process still running from this cluster's temp dir `grace_s` after its node stopped (a
    worker its raylet did not stop), killed."""
    deadline = time.monotonic() + grace_s
    while _under(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = []
    for pid in _under(temp_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            left.append(pid)
    return left


def _under(temp_dir: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if temp_dir in cmdline and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found
