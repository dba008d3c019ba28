"""Each node's forwarder watching the node's rank processes end (rank/forwarder.py `watch_ends`), and
telling when the forwarder itself died: what the driver learns of a node's processes before Ray does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from ...core.deaths import ProcessEnd
from ...core.errors import FailureKind, RankFailure
from ..gang.handle import RankHandle, failure_site


def ranks_by_node(handles: tuple[RankHandle, ...]) -> dict[str, list[RankHandle]]:
    by_node: dict[str, list[RankHandle]] = {}
    for h in handles:
        by_node.setdefault(h.report.node_id, []).append(h)
    return by_node


# A forwarder found dead is the failure only when its node still answers this long after: a node that
# goes takes its forwarder with it, and the node's loss is the cause then.
FORWARDER_GRACE_S = 2.0
FORWARDER_DIED = (
    "its node's output forwarder (megaray's helper process there) died while the rank ran: the node's "
    "output and progress could no longer reach the driver, so megaray ended the attempt (a restart "
    "starts a new forwarder)"
)


class EndsWatch:
    """Each node's forwarder watching the node's rank processes for one to start exiting
    (rank/forwarder.py `watch_ends`): a process that held GPU memory takes seconds to exit, and Ray
    reports it dead after that. The same call tells when the forwarder itself dies."""

    def __init__(self, handles: tuple[RankHandle, ...], forwarders: dict[str, Any]):
        self.handles, self.forwarders = handles, forwarders  # node id -> its output forwarder
        self.watches: dict[Any, str] = {}  # each node's call -> its node id
        self.forwarder_gone: dict[str, float] = {}  # node id -> when its forwarder was found dead
        self.seen_gone: set[int] = set()  # every pid seen ending or gone, whatever its status
        for node, hs in ranks_by_node(handles).items():
            self._watch(node, [h.report.pid for h in hs])

    def forwarders_died(self, at: float, node_gone: Callable[[RankHandle], bool]) -> list[RankFailure]:
        """A failure for each rank of a node whose forwarder was found dead FORWARDER_GRACE_S ago or
        more, its node still there (`node_gone` of one of its ranks False); each node told once."""
        now, failures = time.monotonic(), []
        for node, found in list(self.forwarder_gone.items()):
            if now - found < FORWARDER_GRACE_S:
                continue
            self.forwarder_gone[node] = float("inf")
            on_node = [h for h in self.handles if h.report.node_id == node]
            if on_node and not node_gone(on_node[0]):  # a lost node is told as such, not this
                failures += [
                    RankFailure(**failure_site(h), kind=FailureKind.DIED, summary=FORWARDER_DIED, at=at)
                    for h in on_node
                ]
        return failures

    def live_forwarders(self) -> dict[str, Any]:
        """The forwarders not found dead, by node id: what ships a dead rank's spool (a task where none)."""
        return {node: f for node, f in self.forwarders.items() if node not in self.forwarder_gone}

    def _watch(self, node: str, pids: list[int]) -> None:
        if pids and node in self.forwarders:
            self.watches[self.forwarders[node].watch_ends.remote(pids)] = node

    def ended(self) -> list[tuple[RankHandle, ProcessEnd]]:
        """The ranks found ending since the last call, never waiting: failing, or vanished (whose exit
        mark the caller reads); one that exited with code 0 (os._exit(0)) is left to Ray's report of
        it. Its node's other ranks are watched on."""
        if not self.watches:
            return []
        done, _ = ray.wait(list(self.watches), num_returns=len(self.watches), timeout=0)
        by_pid, out = {h.report.pid: h for h in self.handles}, []
        for ref in done:
            node = self.watches.pop(ref)
            try:
                ends: list[ProcessEnd] = ray.get(ref)
            except ray.exceptions.RayError:  # the node's forwarder is gone: with its node, or alone
                self.forwarder_gone.setdefault(node, time.monotonic())
                continue
            out += [(by_pid[e.pid], e) for e in ends if e.failed or e.vanished]
            self.seen_gone |= {e.pid for e in ends}
            self._watch(node, [h.report.pid for h in self.handles if h.report.node_id == node
                               and h.report.pid not in self.seen_gone])  # fmt: skip
        return out
