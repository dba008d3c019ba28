"""What a rank, or a task on a rank's node, reads on that node: process states and Python stacks (for
hangs), free ports (for MASTER_PORT), the environment a worker started with.

A hung collective holds every GPU of the job until NCCL's watchdog fires (10 minutes by default)
or forever, and says little about why. When the driver sees no activity from any rank for
`--hang-timeout`, a task on each rank's node reads the process state (a SIGSTOPped or swapped-out
rank shows there) and its Python stack with py-spy, which Ray's dashboard also uses; where py-spy
cannot attach, the rank's faulthandler is asked to print its stack into the rank's log.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.deaths import ProcessEnd, RecordedProcess, process_end
from ..core.topology import candidate_ports


def _py_spy() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


@dataclass(frozen=True)
class Stat:
    """What /proc/<pid>/stat says of a process that identifies it."""

    pid: int
    state: str  # R, S, T, Z, ...
    session: int
    start_ticks: int  # when it started, in clock ticks after boot: a reused pid has a later one


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def stat(pid: int) -> Stat | None:
    """None when there is no such process."""
    return _parsed(pid, _read(f"/proc/{pid}/stat"))


def _parsed(pid: int, text: str | None) -> Stat | None:
    if text is None:
        return None
    try:  # the command name may hold spaces and parentheses: the fields follow the last ')'
        fields = text[text.rindex(")") + 2 :].split()
        return Stat(pid, fields[0], int(fields[3]), int(fields[19]))
    except (ValueError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The state letter in /proc/<pid>/stat (R, S, T, Z, ...); None when there is no such process."""
    s = stat(pid)
    return s.state if s else None


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot (what a recorded process is told apart
    by); None when there is no such process."""
    s = stat(pid)
    return s.start_ticks if s else None


def _same(s: Stat | None, started: int | None) -> Stat | None:
    """`s`, where it is the process recorded as started at `started` (None: not recorded, as in a
    state file or a report from an older megaray; then any process with that pid); None where the
    pid is free or another process's now."""
    return s if s is not None and (started is None or s.start_ticks == started) else None


def is_still(pid: int, started: int | None) -> bool:
    """Whether `pid` is running (not a zombie) and is the process that started at `started`."""
    s = _same(stat(pid), started)
    return s is not None and s.state != "Z"


def inspect_process(proc: RecordedProcess) -> dict[str, Any]:
    """On the rank's node: state and Python stack of one rank process (a pid another process holds
    now is "gone": neither attached to nor signalled)."""
    pid = proc.pid
    out: dict[str, Any] = {"pid": pid, "state": "?", "stack": None, "how": None}
    s = _same(stat(pid), proc.started)
    if s is None:
        out["state"] = "gone"
        return out
    out["state"] = s.state
    spy = _py_spy()
    if spy:
        try:
            done = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20
            )
            if done.returncode == 0 and done.stdout.strip():
                out["stack"], out["how"] = done.stdout, "py-spy"
                return out
            out["spy_error"] = (done.stderr or done.stdout).strip().splitlines()[-1:]
        except (OSError, subprocess.SubprocessError) as e:
            out["spy_error"] = [str(e)]
    if out["state"] in ("T", "t"):
        out["how"] = "nobody: a stopped process cannot run its faulthandler (SIGCONT it to inspect)"
        return out
    if not is_still(pid, proc.started):
        out["state"] = "gone"
        return out
    try:  # the rank registered faulthandler on SIGUSR1: its stack goes to its log
        os.kill(pid, signal.SIGUSR1)
        out["how"] = "faulthandler (see the rank's log)"
    except OSError:
        pass
    return out


def inspect_processes(procs: list[RecordedProcess]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=min(8, len(procs) or 1)) as pool:
        return list(pool.map(inspect_process, procs))


def inherited_env() -> dict[str, str]:
    """The environment this worker process started with (what `ray start` ran with on the node).

    Ray changes os.environ after start-up (OMP_NUM_THREADS=<CPUs>, CUDA_VISIBLE_DEVICES); the
    initial block in /proc/self/environ shows what the user had set, which must not be overwritten
    silently.
    """
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def port_is_free(port: int) -> bool:
    """Whether a TCP listener could bind `port` on every interface now (IPv4, and IPv6 if present),
    as the rendezvous store binds it: with SO_REUSEADDR, as torch's TCPStore and rank/store.py's
    `listen` set it, so that a port whose last connections linger in TIME-WAIT (a run of a minute
    ago) is free, as under torchrun, and one a process listens on is not."""
    families = [socket.AF_INET] + ([socket.AF_INET6] if socket.has_ipv6 else [])
    for fam in families:
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                if fam == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", port))
            except OSError as e:
                if fam == socket.AF_INET6 and e.errno != errno.EADDRINUSE:  # no IPv6 here: IPv4 decides
                    continue
                return False
    return True


def ephemeral_range() -> tuple[int, int] | None:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return None


def free_ports(seed: str, count: int, exact: int | None = None) -> list[int]:
    """Up to `count` ports free on this node, in the job's order (`seed`: core/topology.py
    `candidate_ports`, outside the ephemeral range), or `exact` alone if it is free."""
    if exact is not None:
        return [exact] if port_is_free(exact) else []
    found: list[int] = []
    for port in candidate_ports(seed, exclude=ephemeral_range()):
        if port_is_free(port):
            found.append(port)
            if len(found) == count:
                break
    return found


def wait_exited(procs: list[RecordedProcess], grace_s: float) -> tuple[list[float | None], list[int | None]]:
    """On a node: wait up to `grace_s` for each process to end (its atexit handlers and non-daemon
    threads done); SIGKILL those still running then, each only while its pid is still that process.
    Seconds each took (None for the killed), and each one's exit status as waitpid gives it, where it
    was seen exiting (core/deaths.py)."""
    start = time.monotonic()
    took: list[float | None] = [None] * len(procs)
    status: list[int | None] = [None] * len(procs)
    while time.monotonic() - start < grace_s:
        for i, proc in enumerate(procs):
            if took[i] is not None:
                continue
            text = _read(f"/proc/{proc.pid}/stat")  # read once: its state, and how it exits
            s = _same(_parsed(proc.pid, text), proc.started)
            end = process_end(proc.pid, text, None) if s is not None else None
            if end is not None and end.status is not None and status[i] is None:
                status[i] = end.status  # seen exiting (or a zombie): how
            if s is None or s.state == "Z":
                took[i] = round(time.monotonic() - start, 3)
        if all(t is not None for t in took):
            return took, status
        time.sleep(0.02)
    for i, proc in enumerate(procs):
        if took[i] is None and is_still(proc.pid, proc.started):
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
    return took, status


def interface_of(ip: str) -> str | None:
    """The network interface on this node that holds `ip` (the node's Ray IP), or None."""
    import psutil  # a Ray dependency

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addrs):
            return name
    return None


REPLACED_EXIT_TIMEOUT_S = 30.0


def ending(pid: int) -> ProcessEnd | None:
    """Whether process `pid` on this node is ending (core/deaths.py), and with what status."""
    return process_end(pid, _read(f"/proc/{pid}/stat"), _read(f"/proc/{pid}/status"))


def wait_gone(pid: int, timeout_s: float, sooner: Callable[[], bool] | None = None) -> bool:
    """Wait for process `pid` on this node to exit (a zombie has exited), or for `sooner()` to say
    the wait is over (asked every 0.1 s: a warm spare's GPU with room, rank/gpu_room.py); False on
    timeout."""
    deadline, asked = time.monotonic() + timeout_s, 0.0
    while time.monotonic() < deadline:
        if process_state(pid) in (None, "Z"):
            return True
        if sooner is not None and time.monotonic() - asked > 0.1:
            asked = time.monotonic()
            if sooner():
                return True
        time.sleep(0.02)
    return False
