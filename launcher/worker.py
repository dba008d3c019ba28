"""The per-rank actor: it reports where it landed, takes its env, then runs the target in-process.

This module must not import torch (or anything that does) at import time: CUDA reads
CUDA_VISIBLE_DEVICES and OpenMP reads OMP_NUM_THREADS when they first load, and the launcher sets
both in `setup()`, after the actor has started and before the target imports anything.
"""

from __future__ import annotations

import errno
import importlib
import os
import runpy
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import ray

from .spec import Target
from .topology import candidate_ports

_THIS_FILE = str(Path(__file__).resolve())


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
    """Whether a TCP listener could bind `port` on every interface now (IPv4, and IPv6 if present)."""
    families = [socket.AF_INET] + ([socket.AF_INET6] if socket.has_ipv6 else [])
    for fam in families:
        with socket.socket(fam, socket.SOCK_STREAM) as s:
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


REPLACED_EXIT_TIMEOUT_S = 30.0


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait for process `pid` on this node to exit (a zombie has exited); False on timeout."""
    from .hang import process_state

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process_state(pid) in (None, "Z"):
            return True
        time.sleep(0.02)
    return False


class RankActor:
    """One rank. Ray uses `__repr__` as the log prefix, so output reads `(rank3@10.0.0.9/gpu1 ...)`."""

    def __init__(self, job: str, rank: int, node_ip: str):
        self.job = job
        self.rank = rank
        self.node_ip = node_ip
        ctx = ray.get_runtime_context()
        self.gpu_ids = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        self.node_id = ctx.get_node_id()
        self.capture = None

    def __repr__(self) -> str:
        where = f"gpu{','.join(self.gpu_ids)}" if self.gpu_ids else "cpu"
        return f"rank{self.rank}@{self.node_ip}/{where}"

    def info(self) -> dict[str, Any]:
        """Where this rank landed and what it runs on, for the topology and the version check."""
        return {
            "rank": self.rank,
            "node_ip": self.node_ip,
            "node_id": self.node_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": self.gpu_ids,
            "ray_version": ray.__version__,
            "python_version": ".".join(map(str, sys.version_info[:3])),
            "inherited_env": inherited_env(),
        }

    def free_ports(self, seed: str, count: int, exact: int | None = None) -> list[int]:
        """Ports free on this node (the master node: this is rank 0), probed here, not on the driver."""
        if exact is not None:
            return [exact] if port_is_free(exact) else []
        found: list[int] = []
        for port in candidate_ports(seed, exclude=ephemeral_range()):
            if port_is_free(port):
                found.append(port)
                if len(found) == count:
                    break
        return found

    def warm(self, env: dict[str, str], steps: tuple[str, ...]) -> dict[str, Any]:
        """As a spare for the next attempt: take the env and do the imports now (see spares.py)."""
        from .spares import warm

        return warm(env, steps)

    def setup(
        self,
        env: dict[str, str],
        sink: Any = None,
        gpu_ids: list[str] | None = None,
        replaces_pid: int | None = None,
    ) -> dict[str, str]:
        """Apply the rank's env before any framework is imported, and send this process's output to
        `sink` (a launch's OutputSink) from here on. Returns the whole environment the rank now has.

        A spare taking over a rank gets the rank's `gpu_ids` (it holds none of its own; the bundle
        does) and first waits for the old rank's process (`replaces_pid`, on this node) to be gone,
        so that its GPU memory is free before this one uses the GPU.
        """
        if gpu_ids is not None:
            self.gpu_ids = list(gpu_ids)
        if replaces_pid is not None:
            wait_gone(replaces_pid, REPLACED_EXIT_TIMEOUT_S)
        os.environ.update(env)
        if sink is not None and self.capture is None:
            from .output import Capture

            self.capture = Capture(sink, self.rank)
        return dict(os.environ)

    def run(self, target: Target, cwd: str) -> dict[str, Any]:
        """Run the target to completion; a failure comes back as data with its traceback."""
        return self.call(run_target, (target, cwd), {})

    def call(self, fn, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Run `fn(*args, **kwargs)` here (a rank group's method call), failures as data."""
        try:
            value = fn(*args, **kwargs)
            return {"ok": True, "value": value}
        except SystemExit as e:
            if e.code in (None, 0):
                return {"ok": True, "value": None}
            code = e.code if isinstance(e.code, int) else 1
            what = f"exited with code {code}" + ("" if isinstance(e.code, int) else f": {e.code}")
            return _failure("exit", what, e, exit_code=code)
        except BaseException as e:
            return _failure("exception", f"{type(e).__name__}: {e}".strip().splitlines()[0], e)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            if self.capture is not None:
                self.capture.sync()  # the driver has every line of this rank before its result


def _failure(kind: str, summary: str, exc: BaseException, exit_code: int | None = None) -> dict[str, Any]:
    return {
        "ok": False,
        "kind": kind,
        "summary": summary,
        "traceback": user_traceback(exc),
        "exit_code": exit_code,
        "at": time.time(),
    }


def user_traceback(exc: BaseException) -> str:
    """The traceback from the target's first frame on: this module's and runpy's frames are noise."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (_THIS_FILE, runpy.__file__)):
        if tb.tb_next is None:
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


class TargetNotFound(Exception):
    pass


def run_target(target: Target, cwd: str) -> Any:
    """Run the target as torchrun would: scripts and modules as `__main__` with sys.argv set."""
    if os.path.isdir(cwd):
        os.chdir(cwd)
    if target.kind == "dryrun":
        from .dryrun import check_and_train

        return check_and_train(*target.args)
    if target.kind == "megatron":
        from .bridge_target import pretrain_recipe

        return pretrain_recipe(target.recipe, list(target.args), target.hf_path)
    if target.kind == "script":
        path = os.path.join(cwd, target.name)
        if not os.path.isfile(path):
            raise TargetNotFound(
                f"script {path} does not exist on node {socket.gethostname()}; put it on every node "
                "(shared filesystem or the same checkout)"
            )
        sys.argv = [path, *target.args]
        sys.path.insert(0, os.path.dirname(path))
        runpy.run_path(path, run_name="__main__")
        return None
    sys.path.insert(0, cwd)
    if target.kind == "module":
        sys.argv = [target.name, *target.args]
        runpy.run_module(target.name, run_name="__main__", alter_sys=True)
        return None
    module_name, _, func_name = target.name.partition(":")
    func = getattr(importlib.import_module(module_name), func_name, None)
    if not callable(func):
        raise TargetNotFound(f"{module_name} has no function {func_name} on node {socket.gethostname()}")
    sys.argv = [module_name, *target.args]
    return func()
