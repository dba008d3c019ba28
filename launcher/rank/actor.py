"""The per-rank actor: it reports where it landed, takes its env, then runs the target in-process.

This module must not import torch (or anything that does) at import time: CUDA reads
CUDA_VISIBLE_DEVICES and OpenMP reads OMP_NUM_THREADS when they first load, and the launcher sets
both in `setup()`, after the actor has started and before the target imports anything.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import ray

from ..core.errorfile import RecordedError, parse_error_file
from ..core.errors import FailureKind
from ..core.outcome import RankOutcome
from ..core.rankenv import NODE_DEFAULTS
from ..core.runner import TargetRunner
from ..core.straggler import stragglers_off
from ..core.target import Target
from ..core.topology import RankReport
from ..core.versions import python_version
from .capture import Capture, flush_streams
from .nvml import smallest_memory_gib
from .plain_process import as_a_plain_process, match_thread_pools
from .probes import (
    REPLACED_EXIT_TIMEOUT_S,
    free_ports,
    inherited_env,
    interface_of,
    start_ticks,
)
from .serialization import in_a_ray_worker, serializers_when_imported
from .spool import exit_mark, log_dir, mark_exit, mark_os_exit_zero, oom_kills
from .teardown import freeze_for_teardown

if in_a_ray_worker():  # a rank's process, taking its class before its first arguments
    serializers_when_imported()

_THIS_FILE = str(Path(__file__).resolve())
# the frames before the target's (runpy is frozen in Python 3.12)
_NOISE = (_THIS_FILE, runpy.__file__, "<frozen runpy>")


def error_file(spool: str) -> str:
    """Where torch elastic's @record writes the error of a failed rank, as under torchrun: set for the
    program, and emptied of an earlier attempt's."""
    path = spool.removesuffix(".out") + "-error.json"
    os.environ["TORCHELASTIC_ERROR_FILE"] = path
    Path(path).unlink(missing_ok=True)
    return path


def mark_exits(spool: str) -> None:
    """Leave a mark when the process exits (registered before the program's atexit handlers: it runs
    after them), and on the program's os._exit(0), a success too (rank/spool.py); and, after the
    program's handlers too, make the interpreter's teardown cheap (rank/teardown.py)."""
    atexit.register(freeze_for_teardown)
    atexit.register(mark_exit, exit_mark(spool))
    mark_os_exit_zero(exit_mark(spool))


def report_of(rank: int, node_ip: str, node_id: str, gpu_ids: tuple[str, ...]) -> RankReport:
    """This process's RankReport: its node, Ray and Python versions, env, interface, log folder,
    OOM kills so far, and its GPUs' memory."""
    return RankReport(
        rank=rank,
        node_ip=node_ip,
        node_id=node_id,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        gpu_ids=gpu_ids,
        ray_version=ray.__version__,
        python_version=python_version(),
        inherited_env=inherited_env(),
        iface=interface_of(node_ip),
        log_dir=log_dir(),
        oom_kills=oom_kills(),
        gpu_memory_gib=smallest_memory_gib() if gpu_ids else None,
        started=start_ticks(os.getpid()),
    )


class RankActor:
    """One rank. Ray uses `__repr__` as the log prefix, so output reads `(rank3@10.0.0.9/gpu1 ...)`."""

    def __init__(self, job: str, rank: int, node_ip: str, pooled: dict[str, Any] | None = None):
        for key in NODE_DEFAULTS:  # Ray's, for starting this process (core/rankenv.py)
            os.environ.pop(key, None)
        self.job = job
        self.rank = rank
        self.node_ip = node_ip or ray.util.get_node_ip_address()
        ctx = ray.get_runtime_context()
        self.gpu_ids = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        self.node_id = ctx.get_node_id()
        self.capture = None
        self.store_host = None  # rank 0's: the rendezvous store (rank/store.py)
        self.claimed_by: str | None = None
        self.exit_marked = False
        self.error_file: str | None = None  # TORCHELASTIC_ERROR_FILE, set with the env
        self.gpu_use = None  # a spare's watch of its rank's GPU memory (rank/gpu_room.py)
        self.took_over: str | None = None  # a spare: when its rank's process was gone, or its GPU had room
        if (
            pooled
        ):  # a pool's process (driver/cluster/pool.py): import now if warm, give the bundle back when idle
            from .warmup import expire_when_idle, warm

            self.warmed = warm(pooled["env"], tuple(pooled["steps"]))
            expire_when_idle(self, pooled["group"], pooled["idle_timeout_s"], pooled.get("sinks"))
        self.atexit_before = atexit._ncallbacks()

    def __repr__(self) -> str:
        where = f"gpu{','.join(self.gpu_ids)}" if self.gpu_ids else "cpu"
        return f"rank{self.rank}@{self.node_ip}/{where}"

    def info(self) -> RankReport:
        """Where this rank landed and what it runs on, for the topology and the version check."""
        return report_of(self.rank, self.node_ip, self.node_id, tuple(self.gpu_ids))

    def free_ports(self, seed: str, count: int, exact: int | None = None) -> list[int]:
        """Ports free on this node (the master node: this is rank 0), probed here, not on the driver."""
        return free_ports(seed, count, exact)

    def claim(self, job: str) -> bool:
        """A launch takes this warm pool process; only the first asking gets it."""
        if self.claimed_by is not None:
            return False
        self.claimed_by = self.job = job
        return True

    def open_rendezvous(self, port: int) -> None:
        """On the master rank: listen on MASTER_PORT for the other ranks' reachability probe."""
        from .links import Listener

        self.listener = Listener(port)

    def close_rendezvous(self) -> None:
        listener, self.listener = getattr(self, "listener", None), None
        if listener is not None:
            listener.close()

    def reach(self, host: str, port: int, timeout_s: float) -> str | None:
        """From this rank's node: can MASTER_ADDR:MASTER_PORT be reached? None, or why not."""
        from .links import reach

        return reach(host, port, timeout_s)

    def warm(
        self, env: dict[str, str], steps: tuple[str, ...], own_program_next: bool = False,
        prepare: tuple[TargetRunner, Target] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Take the env and do the imports now (then the runner's `prepare`): as a spare for the next
        attempt (driver/gang/spares.py), or as a rank whose program waits for the preflight's verdict
        (`own_program_next`: driver/lifecycle/attempt.py `import_ahead`)."""
        from .warmup import warm

        return warm(env, steps, own_program_next, prepare)

    def watch_gpu(self, gpu_ids: list[str]) -> None:
        """A spare: watch how much memory its rank uses on these GPUs, to know when they have room for
        the rank's successor while the old process still exits (rank/gpu_room.py)."""
        from .gpu_room import GpuUse

        if gpu_ids and self.gpu_use is None:
            self.gpu_use = GpuUse(gpu_ids)

    def setup(
        self,
        env: dict[str, str],
        sink: Any = None,
        gpu_ids: tuple[str, ...] | None = None,
        replaces_pid: int | None = None,
        spool: str | None = None,
        rank: int | None = None,
        host_store: bool = False,
    ) -> tuple[dict[str, str], str | None]:
        """Apply the rank's env before any framework is imported, and send this process's output to
        `sink` (a launch's OutputSink, driver/output/relay.py) from here on, through the file `spool` on this
        node (rank/spool.py). Rank 0 (`host_store`) takes MASTER_PORT for the rendezvous store it
        serves (rank/store.py). Returns the whole environment the rank now has, and for a spare when
        it took over (`took_over`).

        A spare taking over a rank gets the rank's `gpu_ids` (it holds none of its own; the bundle
        does) and first waits for the old rank's process (`replaces_pid`, on this node) to be gone,
        so that its GPU memory is free before this one uses the GPU.
        """
        started = time.monotonic()
        if rank is not None:  # a warm pool's process learns its rank now
            self.rank = rank
        if gpu_ids is not None:
            self.gpu_ids = list(gpu_ids)
        if replaces_pid is not None:
            from .gpu_room import wait_replaced

            how = wait_replaced(replaces_pid, self.gpu_use, REPLACED_EXIT_TIMEOUT_S)
            self.took_over = f"{how} after {time.monotonic() - started:.2f} s"
        if host_store and self.store_host is None:
            from .store import serve_store

            self.store_host = serve_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        os.environ.update(env)
        # A plain process's SIGTERM, as under torchrun: it ends the rank at once unless the program
        # installs a handler of its own (Megatron-Bridge saves a checkpoint in one). Ray's worker
        # handler would otherwise turn it into an exception the program may swallow.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        as_a_plain_process()
        match_thread_pools()
        if spool is not None:
            self.error_file = error_file(spool)
            if not self.exit_marked:
                mark_exits(spool)
                self.exit_marked = True
        self.atexit_before = atexit._ncallbacks()
        if sink is not None and spool is not None and self.capture is None:
            self.capture = Capture(sink, self.rank, spool)
        return dict(os.environ), self.took_over

    def run(self, runner: TargetRunner, target: Target, cwd: str) -> RankOutcome:
        """Run the target to completion; a failure comes back as data with its traceback. A program
        that returns while non-daemon threads run or with atexit handlers registered is reported as
        lingering: its process must end on its own, as a Python process does, not be killed."""
        before = signal.getsignal(signal.SIGTERM)
        sampler = None
        # the driver's straggler detection (rank/waits.py); `--env MEGARAY_STRAGGLERS=off` turns it off
        watched = not stragglers_off(os.environ)
        if self.capture is not None and runner.looks_at_waits and watched:
            from .waits import WaitSampler

            world = int(os.environ.get("WORLD_SIZE", "1"))
            sampler = WaitSampler(self.capture.sink, self.rank, threading.get_ident(), world)
        try:
            result = self.call(runner.run, (target, cwd), {}, noise=runner.own_files())
        finally:
            if sampler is not None:
                sampler.stop()
        if not result.ok:
            _restore(signal.SIGTERM, before)
            return result
        if self.capture is not None:
            self.capture.end_control()
        return replace(result, lingering=tuple(lingering(self.atexit_before)))

    def leave(self) -> None:
        """Exit as a Python process does (non-daemon threads joined, atexit handlers run), told by the
        driver once every rank returned. The output thread stops calling Ray first (Capture
        `stop_sending`): Ray's worker is shut down before the exit handlers run."""
        if self.capture is not None:
            self.capture.stop_sending()
        ray.actor.exit_actor()

    def call(self, fn, args: tuple, kwargs: dict, noise: tuple[str, ...] = ()) -> RankOutcome:
        """Run `fn(*args, **kwargs)` here (a rank group's method call), failures as data; tracebacks
        start after the frames of `noise`'s files (a runner's own)."""
        noise = (*_NOISE, *noise)
        try:
            return RankOutcome(ok=True, value=fn(*args, **kwargs))
        except SystemExit as e:
            caught = _caught(self.capture)
            if e.code in (None, 0):
                return RankOutcome(ok=True)
            if isinstance(e.code, int):
                code, what = e.code, f"exited with code {e.code}"
            else:  # sys.exit("message"): printed, as Python prints it, and exit code 1
                code, what = 1, f"exited with code 1: {e.code}"
                with contextlib.suppress(OSError, ValueError):
                    print(e.code, file=sys.stderr, flush=True)
            return _failure(FailureKind.EXIT, what, e, code, self.error_file, noise, caught)
        except BaseException as e:
            caught = _caught(self.capture)
            # as Python prints an exception that ends a program (with exit code 1): the rank's log
            # keeps it too
            with contextlib.suppress(OSError, ValueError):
                print(user_traceback(e, noise), end="", file=sys.stderr, flush=True)
            summary = f"{type(e).__name__}: {e}".strip().splitlines()[0]
            return _failure(FailureKind.EXCEPTION, summary, e, 1, self.error_file, noise, caught)
        finally:
            flush_streams()
            if self.capture is not None:
                self.capture.call_ended()  # a stop from here on leaves the result to come back
                self.capture.sync()  # the driver has every line of this rank before its result
                self.capture.returning = False


class Caught(NamedTuple):
    """A failure as the rank caught it."""

    at: float  # the wall clock
    after_stop: bool  # the driver's stop had reached this process first


def _caught(capture: Capture | None) -> Caught:
    """When the program failed, and whether the driver's stop had reached it by then: taken first,
    before its traceback is printed (a slow disk, a loaded machine)."""
    return Caught(time.time(), capture.call_ended() if capture is not None else False)


def _restore(signum: int, handler: Any) -> None:
    """After a program ended in a failure, its own signal handler goes: the teardown that follows
    (Ray's kill of this process) must not run it again, as no signal reaches a torchrun worker whose
    program has ended (a SIGTERM handler that saved a checkpoint and exited ran a second time, into
    the kill)."""
    with contextlib.suppress(ValueError, TypeError):  # not the main thread; a handler set from C
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


def lingering(atexit_before: int) -> list[str]:
    """What would still run if this process exited now: non-daemon threads, new atexit handlers."""
    threads = [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]
    added = atexit._ncallbacks() - atexit_before
    return [f"thread {name}" for name in threads] + ([f"{added} atexit handler(s)"] if added > 0 else [])


def _failure(
    kind: FailureKind, summary: str, exc: BaseException, exit_code: int, error_file: str | None,
    noise: tuple[str, ...], caught: Caught,
) -> RankOutcome:  # fmt: skip
    """A failed run as data. Where the program recorded its error (torch elastic's `@record` writes
    TORCHELASTIC_ERROR_FILE), its message and traceback are the ones reported, as under torchrun."""
    recorded = _recorded(error_file)
    return RankOutcome(
        ok=False,
        kind=kind,
        summary=recorded.message.splitlines()[0] if recorded and recorded.message else summary,
        traceback=recorded.traceback if recorded and recorded.traceback else user_traceback(exc, noise),
        exit_code=exit_code,
        at=caught.at,
        after_stop=caught.after_stop,
        error_file=error_file if recorded else "",
    )


def _recorded(error_file: str | None) -> RecordedError | None:
    try:
        return parse_error_file(Path(error_file).read_text()) if error_file else None
    except OSError:
        return None


def user_traceback(exc: BaseException, noise: tuple[str, ...] = _NOISE) -> str:
    """The traceback from the target's first frame on: this module's, the runner's and runpy's frames
    are noise."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in noise:
        if tb.tb_next is None:
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))
