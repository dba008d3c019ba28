"""Ranks whose program returned, exiting as Python processes do: watched on their nodes, killed and
named past the grace, and a crash on the way out counted as torchrun counts a worker's exit status."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Any

import ray

from ...core.deaths import ProcessEnd, death_cause, ray_teardown_crash, readable_tail
from ...core.errors import FailureKind, RankFailure
from ...core.topology import format_rank_ranges
from ...rank.spool import exit_and_ship, exit_mark
from ..gang.actors import first_line, on_node, wait_all
from ..gang.handle import RankHandle
from ..lifecycle.stop import StopSignal
from ..output.shipping import in_thread, spools_of
from .process_ends import ranks_by_node

log = logging.getLogger("megaray")


def _tail(sink: Any, rank: int) -> list[str]:
    try:
        return ray.get(sink.tail.remote(rank), timeout=5) if sink is not None else []
    except ray.exceptions.RayError:
        return []


def _mark(h: RankHandle) -> str | None:
    return exit_mark(h.spool) if h.spool else None


def crash_on_exit(
    h: RankHandle, tail: list[str] | tuple[str, ...], at: float, status: int | None = None
) -> RankFailure:
    """The failure of a rank whose program returned and whose process then died on its way out
    (`status`: its exit status, where its node saw it exiting)."""
    ended = ProcessEnd(h.report.pid, status) if status is not None else None
    cause = death_cause(tail, None, ended) or "it ended without finishing its exit"
    return RankFailure(
        rank=h.slot.rank, node_ip=h.slot.node_ip, hostname=h.report.hostname, gpu=h.info.gpu,
        kind=FailureKind.DIED,
        summary=f"after the program returned, on its way out (exit handlers, threads): {cause}",
        at=at, last_output=readable_tail(tail), local_rank=h.slot.local_rank, pid=h.report.pid,
    )  # fmt: skip


def exit_gracefully(
    handles: tuple[RankHandle, ...],
    sink: Any,
    lingering: dict[int, list[str]],
    grace_s: float,
    stop: StopSignal,
    forwarders: Mapping[str, Any],
) -> list[RankFailure]:
    """Watch the processes of ranks told to exit (`handles`; `lingering`: what each returned rank's
    process still ran, to name in a kill) end as Python processes do (non-daemon threads
    joined, atexit handlers run: trackers flush, uploads finish), each by a task on its node; kill
    and name those still running after `grace_s`; then what they printed on the way out reaches
    the sink. Ctrl-C stops the wait. Returns the ranks whose process died on the way out (a crash in
    an exit handler, a signal, os._exit), each as a failure, as torchrun counts a worker's exit status.

    The ranks on the driver's own node are watched from the driver, in a thread, those of another
    node by its output forwarder (`forwarders`, by node id), and by a task there only where it has
    none left: a task first waits for Ray to start a worker process, about a second on a small
    machine (output/shipping.py `ship_from` chooses so too)."""
    by_node = ranks_by_node(handles)
    here = ray.get_runtime_context().get_node_id()
    task = ray.remote(exit_and_ship)
    watches: dict[str, Any] = {}  # node -> the task's ref, or the driver thread's future
    for node, hs in by_node.items():
        procs, spools, marks = [h.report.process for h in hs], spools_of(hs), [_mark(h) for h in hs]
        if node == here:
            watches[node] = in_thread(exit_and_ship, procs, grace_s, sink, spools, marks)
        elif (forwarder := forwarders.get(node)) is not None:
            watches[node] = forwarder.exit_and_ship.remote(procs, grace_s, spools, marks)
        else:
            watches[node] = task.options(**on_node(node)).remote(procs, grace_s, sink, spools, marks)
    deadline = time.monotonic() + grace_s + 60
    wait_all([w for w in watches.values() if not isinstance(w, Future)], grace_s + 60, stop)
    for w in watches.values():
        if isinstance(w, Future):
            while not w.done() and time.monotonic() < deadline:
                stop.check()
                wait_futures([w], timeout=0.25)
    killed, crashed = [], []
    for node, w in watches.items():
        try:
            ended = w.result(timeout=0) if isinstance(w, Future) else ray.get(w, timeout=0)
        except (ray.exceptions.RayError, FutureTimeout, OSError) as e:
            log.warning("could not watch the ranks on node %s exit: %s", node[:8], first_line(e))
            continue
        for h, (took, clean, status) in zip(by_node[node], ended, strict=True):
            if took is None:
                killed.append(h.slot.rank)
            elif not clean:
                crashed.append((h.slot.rank, status))
    if killed:
        still = sorted({x for r in killed for x in lingering.get(r, [])})
        log.warning(
            "rank(s) %s still running %gs after the program returned (%s): killed; give them longer "
            "with --exit-grace", format_rank_ranges(killed), grace_s, ", ".join(still) or "exit handlers",
        )  # fmt: skip
    at = time.time()
    failures = []
    for rank, status in crashed:
        tail = _tail(sink, rank)
        if ray_teardown_crash(tail):  # not the program's: its work is done, so it is not a failure
            log.warning(
                "rank %d's process crashed in Ray's own teardown after the program returned (%s): not "
                "counted as a failure of the program", rank, readable_tail(tail)[-1] if tail else "?",
            )  # fmt: skip
            continue
        failures.append(crash_on_exit(handles[rank], tail, at, status))
    return failures
