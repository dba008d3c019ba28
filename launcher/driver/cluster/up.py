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
import fcntl
import json
import logging
import os
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import ClusterError, Interrupted, UsageError
from ...core.raytoken import auth_disabled, find_token, token_path
from ...rank.probes import is_still, start_ticks
from . import up_nodes as nodes_of_up
from .owned import session_members

log = logging.getLogger("megaray")

# An up interrupted while its nodes start: nothing of a user's runs there yet, so Ray's processes are
# given this long to end on SIGTERM, not a running node's 30 s. A node's dashboard and runtime-env
# agents, still importing, look for their raylet only once up (12-14 s after the SIGTERM on a busy
# 2-core machine, 30 s in a CI run), and a `ray start` inside a call to the GCS acts on it only when
# that call returns.
STARTING_GRACE_S = 3.0


def state_dir() -> Path:
    """Private to this user: the state file and the cluster's Ray temp dir (short, for Ray's sockets)."""
    d = Path(os.environ.get("MEGARAY_STATE_DIR") or Path(tempfile.gettempdir()) / f"megaray-{os.getuid()}")
    why = None
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):  # there, but read-only: the lock, the log, the state
            why = "Permission denied"
    except OSError as e:
        why = e.strerror or str(e)
    if why is not None:
        named = (
            "MEGARAY_STATE_DIR names" if os.environ.get("MEGARAY_STATE_DIR") else "megaray keeps its state in"
        )
        raise UsageError(
            f"{named} {d}, which is not a folder megaray can use ({why}): point "
            "MEGARAY_STATE_DIR at a writable folder"
        )
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
    starts: tuple[
        int | None, ...
    ] = ()  # each pid's start time (driver/cluster/owned.py), to know it is still ours

    def nodes_started(self) -> list[tuple[int, int | None]]:
        """(pid, start time) of each node's `ray start`, head first."""
        return [(pid, self.starts[i] if i < len(self.starts) else None) for i, pid in enumerate(self.pids)]

    def describe(self) -> str:
        unit = "GPUs" if self.device == "gpu" else "CPU ranks"
        return f"{self.address} ({self.nodes} node(s) x {self.gpus_per_node} {unit})"


def _path() -> Path:
    return state_dir() / "up.json"


def running() -> Standing | None:
    """The `megaray up` cluster if its head is alive; a stale state file is removed."""
    path = _path()
    try:
        data = json.loads(path.read_text())
        state = Standing(**{**data, "pids": tuple(data["pids"]), "starts": tuple(data.get("starts", ()))})
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if is_still(*state.nodes_started()[0]):
        return state
    with contextlib.suppress(OSError):
        path.unlink()
    return None


@contextlib.contextmanager
def one_at_a_time() -> Iterator[None]:
    """Held by a `megaray up` from its look for a running one to its state file written: a second
    `up` started meanwhile waits here, then finds the first one running (two at once both started a
    Ray, the state file recorded one, and `down` never saw the other)."""
    path = state_dir() / "up.lock"
    with open(path, "a") as held:
        os.chmod(path, 0o600)
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info(
                "another `megaray up` is starting a Ray with this state (%s): waiting for it", path.parent
            )
            fcntl.flock(held, fcntl.LOCK_EX)
        yield


def start(
    nodes: int, gpus_per_node: int, device: str, cpus_per_rank: float = 1.0,
    when_ready: Callable[[], None] | None = None, starting: str = "",
) -> Standing:  # fmt: skip
    """Start the cluster and wait until every node has registered; then, still connected, call
    `when_ready` (which starts a warm pool, driver/cluster/pool.py). `starting`: a line said once the input
    is known good (the token), before the seconds the nodes take."""
    import ray

    from ...core.spec import RAY_NAMESPACE as NAMESPACE
    from .auth import token_mode
    from .nodeenv import node_env

    root = state_dir()
    temp_dir = root / "ray"
    cpus = max(1, int(cpus_per_rank * gpus_per_node + 0.999))
    gpus = gpus_per_node if device == "gpu" else 0
    env = node_env(os.environ)
    env.pop("RAY_ADDRESS", None)
    # Ray 2.60's default for a new head; a worker joining by address needs it said
    env.setdefault("RAY_AUTH_MODE", "token")
    if not auth_disabled(env):
        ensure_token(env, Path.home())
    if starting:
        log.info("%s", starting)
    per_node = ["--num-cpus", str(cpus), "--num-gpus", str(gpus)]
    logs = root / "up.log"
    procs: list[subprocess.Popen] = []  # the nodes' `ray start`, head first, each as soon as it runs
    state = Standing("", nodes, gpus_per_node, device, (), str(temp_dir), time.time(), cpus_per_rank)
    _raise_on_signals()  # Ctrl-C or SIGTERM while the nodes start: stop those started, then exit
    try:
        head = ["--node-ip-address", "127.0.0.1", "--include-dashboard", "false", "--temp-dir", str(temp_dir)]
        address = nodes_of_up.start_head([*head, *per_node], logs, env, procs)
        state = dataclasses.replace(state, address=address)
        with token_mode(address, announce=False):
            try:
                ray.init(
                    address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING
                )
            except (ConnectionError, RuntimeError) as e:  # its GCS, up, did not answer in Ray's time
                raise ClusterError(
                    f"the local Ray's head started at {address} but did not let this process in "
                    f"({str(e).splitlines()[0]}); the nodes started are stopped: run `megaray up` again "
                    "(on a machine this busy, Ray's own calls time out)"
                ) from None
            _raise_on_signals()  # ray.init put its own SIGTERM handler, which aborts the process
            try:
                for _ in range(nodes - 1):  # one at a time: raylets registering together time out on 2 cores
                    before = nodes_of_up.count_alive()
                    # one log monitor a machine, as Ray says: each tails the same session's logs
                    # (what a rank group streams would come twice), for a share of a core each
                    joined = ["--address", address, "--include-log-monitor", "false", *per_node]
                    procs.append(nodes_of_up.start_node(joined, logs, env))
                    nodes_of_up.wait_until(lambda b=before: nodes_of_up.count_alive() > b, procs[-1], logs)
                state = _recorded(state, procs)
                if when_ready is not None:
                    when_ready()
            finally:
                ray.shutdown()
    except BaseException as e:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the nodes are stopped whatever comes now
            signal.signal(sig, signal.SIG_IGN)
        stop(_recorded(state, procs), wait_s=STARTING_GRACE_S, sweep_s=STARTING_GRACE_S)
        if isinstance(e, SystemExit) and e.code == signal.SIGTERM:  # Ray's driver handler: sys.exit(15)
            raise Interrupted(signal.SIGTERM, "SIGTERM") from None
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(signal.SIGINT, "SIGINT") from None
        raise
    state = _recorded(state, procs)
    _path().write_text(json.dumps(dataclasses.asdict(state)))
    with contextlib.suppress(OSError):  # an earlier `down` cut short left its mark
        _stopping().unlink()
    os.chmod(_path(), 0o600)
    return state


def _raise_on_signals() -> None:
    """SIGINT and SIGTERM raise Interrupted here (the caller's `except` stops the nodes started)."""

    def handler(signum: int, _frame: object) -> None:
        raise Interrupted(signum, signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


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


def _recorded(state: Standing, procs: list[subprocess.Popen]) -> Standing:
    """The state with every node started so far, each with its start time (taken right after it
    started: our child, so its pid cannot have been reused yet)."""
    known = dict(zip(state.pids, state.starts, strict=False))
    starts = tuple(known[p.pid] if p.pid in known else start_ticks(p.pid) for p in procs)
    return dataclasses.replace(state, pids=tuple(p.pid for p in procs), starts=starts)


def stop(state: Standing, wait_s: float = 30.0, sweep_s: float = 10.0) -> list[int]:
    """SIGTERM each node's `ray start --block` (workers first), then SIGKILL its process group if it
    is still there after `wait_s`; then whatever Ray process of those nodes' sessions is left
    `sweep_s` later. Only processes megaray started are signalled (driver/cluster/owned.py): a recorded pid
    that is now another process, and anything outside the nodes' sessions, are left alone. Returns
    the pids killed."""
    nodes = list(reversed(state.nodes_started()))
    mark_stopping(state)
    for pid, started in nodes:
        if is_still(pid, started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    killed = []
    deadline = time.monotonic() + wait_s
    for pid, started in nodes:
        while is_still(pid, started) and time.monotonic() < deadline:
            time.sleep(0.1)
        if is_still(pid, started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # it leads its own group (started in a session of its own)
            killed.append(pid)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
    killed += _sweep(nodes, sweep_s)
    with contextlib.suppress(OSError):
        _path().unlink()
    with contextlib.suppress(OSError):
        _stopping().unlink()
    return killed


def _stopping() -> Path:
    return state_dir() / "up.stopping"


def mark_stopping(state: Standing) -> None:
    """From here on, a launch on it whose ranks end says why (`stopped_under`): `down` gives the pool
    back first, which ends a launch's ranks taken from it, before it stops the nodes."""
    with contextlib.suppress(OSError):
        _stopping().write_text(state.address)


def stopped_under(address: str) -> bool:
    """Whether the `megaray up` Ray at `address` is being stopped or is gone: told to a launch on it
    whose ranks ended with it."""
    with contextlib.suppress(OSError):
        if _stopping().read_text() == address:
            return True
    standing = running()
    return standing is None or standing.address != address


def launches_on_it() -> list[str]:
    """The other drivers connected to the Ray this process is connected to (launches on `megaray up`):
    what `megaray down` ends with it, each as its pid and command line (the GCS's job table)."""
    import ray

    from .rayprivate import drivers_running

    mine = ray.get_runtime_context().get_job_id()
    try:
        return [f"pid {pid}: {entrypoint}" for job, pid, entrypoint in drivers_running() if job != mine]
    except Exception:  # nothing to say: the nodes are stopped all the same
        return []


def _sweep(nodes: list[tuple[int, int | None]], grace_s: float = 10.0) -> list[int]:
    """Any process still running in a node's session `grace_s` after the node stopped (a worker its
    raylet did not stop), killed."""
    deadline = time.monotonic() + grace_s
    while _left(nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = []
    for pid, started in _left(nodes):
        if is_still(pid, started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                left.append(pid)
    return left


def _left(nodes: list[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
    me = os.getpid()
    return [
        (m.pid, m.start_ticks)
        for leader, started in nodes
        for m in session_members(leader, started)
        if m.pid != me
    ]
