"""A rank's output spool (rank/spool.py), shipped to the launch's sink from the rank's node: by a
task there, or by a thread of the driver on its own node (a task would first wait for Ray to start a
worker process). What a dead rank printed last reaches its log and its failure this way."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import ray

from ...core.deaths import RecordedProcess
from ...core.outbatch import Source
from ...core.topology import RankReport
from ...rank.spool import exited_cleanly, ship, spool_files, spool_name
from ..gang.actors import on_node
from ..gang.handle import RankHandle


def spool_path(report: RankReport, job: str, rank: int) -> str | None:
    return os.path.join(report.log_dir, spool_name(job, rank, report.pid)) if report.log_dir else None


def spools_of(handles: list[RankHandle] | tuple[RankHandle, ...]) -> list[tuple[Source, str]]:
    return [f for h in handles if h.spool for f in spool_files(h.slot.rank, h.spool)]


def ship_from(
    node: str, sink: Any, spools: list[tuple[Source, str]], forwarders: Mapping[str, Any] | None = None
) -> Any:
    """Ship `spools` (rank/spool.py `ship`) from their node: on the driver's own node, a thread of the
    driver; elsewhere the node's output forwarder where it has one (`forwarders`, by node id), else a
    task there (a task first waits for Ray to start a worker process, about a second on a small
    machine and past the report's wait on a loaded one, on the way to every failure report and to the
    exit after Ctrl-C). An ObjectRef or a Future."""
    if node == ray.get_runtime_context().get_node_id():
        return in_thread(ship, sink, spools, True)
    if (forwarder := (forwarders or {}).get(node)) is not None:
        return forwarder.ship.remote(spools)
    return ray.remote(ship).options(**on_node(node)).remote(sink, spools, True)


def read_exit_mark(node: str, mark: str, forwarders: Mapping[str, Any]) -> bool:
    """rank/spool.py `exited_cleanly` of `mark` on `node`, chosen as `ship_from` chooses: here on the
    driver's own node, else by the node's output forwarder, else by a task there; False where it
    cannot be told within 10 s."""
    if node == ray.get_runtime_context().get_node_id():
        return exited_cleanly(mark)
    try:
        if (forwarder := forwarders.get(node)) is not None:
            return bool(ray.get(forwarder.exit_marked.remote(mark), timeout=10))
        return bool(ray.get(ray.remote(exited_cleanly).options(**on_node(node)).remote(mark), timeout=10))
    except (ray.exceptions.RayError, TimeoutError):
        return False


def inspect_on(node: str, procs: list[RecordedProcess], forwarders: Mapping[str, Any]) -> Any:
    """rank/probes.py `inspect_processes` (a hang's stacks) on `node`, by its output forwarder, else
    by a task there (which first waits for Ray to start a worker); an ObjectRef."""
    if (forwarder := forwarders.get(node)) is not None:
        return forwarder.inspect.remote(procs)
    from ...rank.probes import inspect_processes

    return ray.remote(inspect_processes).options(**on_node(node)).remote(procs)


def wait_shipped(pending: list[Any], timeout_s: float) -> set[Any]:
    """Which of `pending` (ObjectRefs and Futures) are done within `timeout_s`, waited for together."""
    deadline = time.monotonic() + timeout_s
    refs = [p for p in pending if not isinstance(p, Future)]
    done = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0]) if refs else set()
    futures = [p for p in pending if isinstance(p, Future)]
    if futures:
        done |= wait_futures(futures, timeout=max(0.0, deadline - time.monotonic())).done
    return done


def shipped(x: Any) -> dict[str, Any]:
    return x.result(timeout=0) if isinstance(x, Future) else ray.get(x, timeout=0)


def in_thread(fn: Any, *args: Any) -> Future:
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="megaray-exit-watch", daemon=True).start()
    return future
