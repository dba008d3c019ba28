"""How ranks end, as the driver learns it: what a rank's program returned or raised, a process
ending or a node lost (told by the nodes' forwarders and megaray's probes), a dead rank's last
output, a hung rank's state and stack, each read by a task on its node (rank/spool.py,
rank/probes.py). Ranks whose program returned exit in exits.py."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
from typing import Any

import ray

from ...core.deaths import ProcessEnd, death_cause, describe_death, readable_tail
from ...core.errors import FailureKind, RankFailedError, RankFailure
from ...core.topology import RankSlot, format_rank_ranges
from ...rank.spool import exit_mark
from ..gang.actors import first_line
from ..gang.handle import RankHandle, failure_site
from ..output.shipping import inspect_on, read_exit_mark, ship_from, shipped, spools_of, wait_shipped
from .liveness import NodeProbes
from .process_ends import EndsWatch, ranks_by_node

log = logging.getLogger("megaray")


INSPECT_WAIT_S = 60.0  # for every node's reading of its ranks' stacks, together (not per node)
SALVAGE_WAIT_S = 10.0  # for a dead rank's spool to reach the sink before the report is made


def _program_failure(h: RankHandle, out: Any) -> RankFailure:
    """The failure a rank's program returned (core/outcome.RankOutcome: it raised or exited non-zero)."""
    return RankFailure(
        **failure_site(h), kind=out.kind, summary=out.summary, traceback=out.traceback,
        exit_code=out.exit_code, at=out.at, error_file=out.error_file,
    )  # fmt: skip


def failed_on_their_own(handles: tuple[RankHandle, ...], refs: list) -> list[RankFailure]:
    """The ranks whose program failed (raised, or exited non-zero) before the driver's stop reached
    them, among `refs` (by rank) that are done: their word came after the first failure's window
    (4 ranks raising at once reach the driver over a second), and torchrun lists every failed worker.
    Each rank tells whether the stop had come first (rank/capture.py `call_ended`): no clock of the
    driver's is compared with a rank's. What the stop ended, and a process that died, are not listed."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    rank_of, found = {ref: r for r, ref in enumerate(refs)}, []
    for ref in done:
        with contextlib.suppress(ray.exceptions.RayError):
            out = ray.get(ref, timeout=0)
            if not out.ok and not out.after_stop:
                found.append(_program_failure(handles[rank_of[ref]], out))
    return found


def lost_summary(slots: list[RankSlot], how: str) -> str:
    """What each rank of a lost node failed of (`slots`: that node's ranks)."""
    ranks = format_rank_ranges(s.rank for s in slots)
    node = f"{slots[0].node_ip} (node id {slots[0].node_id[:8]})"
    return f"its node {node} was lost: {how}; it took rank(s) {ranks} with it"


def lost_while_starting(slots: list[RankSlot], lost: dict[str, str]) -> RankFailedError:
    """The ranks of nodes found lost before their actors had started (no process, no GPU yet);
    `lost`: node id -> how it was found lost."""
    failures, at = [], time.time()
    for node_id, how in lost.items():
        on_node = [s for s in slots if s.node_id == node_id]
        failures += [
            RankFailure(rank=s.rank, node_ip=s.node_ip, hostname=s.hostname, gpu="-", kind=FailureKind.DIED,
                        summary=lost_summary(on_node, how), at=at, local_rank=s.local_rank)
            for s in on_node
        ]  # fmt: skip
    return RankFailedError(failures, len(slots))


def fail_if_lost(ends: RankEnds, slots: list[RankSlot], lost: dict[str, str]) -> None:
    """Raise the failure of the ranks of `lost` nodes (node id -> how), known lost to the launch."""
    if lost:
        ends.lost.update(dict.fromkeys(lost, True))
        raise lost_while_starting(slots, lost)


def silent(silent_s: float, why: str, when: str = "") -> str:
    """How the probes found a node lost (`when`: " while its ranks started", before they ran)."""
    return f"no answer from it for {silent_s:.0f}s{when} ({why}: a cut link or a dead machine)"


def node_lost(node_id: str) -> bool:
    """Whether a node is gone: dead for Ray already, or its raylet refuses or ignores a connection
    (a node whose raylet died, or whose link was cut, before Ray's health checks tell)."""
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    if node is None or not node["Alive"]:
        return True
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=0.5):
            return False
    except OSError:
        return True


def _status(exit_code: int | None) -> int | None:
    """A failure's exit code (minus the signal, as torch elastic's) as waitpid's status again."""
    if exit_code is None:
        return None
    return -exit_code if exit_code < 0 else exit_code << 8


class RankEnds:
    """How the running ranks of a gang end, and what the driver learns of them as they do: which
    nodes are lost, whose last output is being shipped, what a returned rank's process still runs.
    It is what a Supervision looks at (driver/supervision/supervise.py: the calls that ended, their
    outcomes, a hang's stacks, the nodes); the attempt's teardown asks it for the last words."""

    def __init__(
        self, handles: tuple[RankHandle, ...], sink: Any, probes: NodeProbes | None = None,
        forwarders: dict[str, Any] | None = None,
    ):  # fmt: skip
        self.handles, self.sink = handles, sink  # no sink: a rank group, whose output Ray streams
        self.probes = probes  # megaray's own liveness probes of the nodes (driver/supervision/liveness.py)
        self.lost: dict[str, bool] = {}  # node id -> gone, asked once per node as its ranks die
        self.salvaging: dict[int, Any] = {}  # rank -> the task shipping a dead rank's spool
        self.lingering: dict[int, list[str]] = {}  # what each returned rank's process still runs
        self.ends = EndsWatch(handles, forwarders or {})

    @property
    def world_size(self) -> int:
        return len(self.handles)

    def forwarders(self) -> dict[str, Any]:
        """The nodes' output forwarders not found dead, by node id: what watches and ships on a node
        without waiting for Ray to start a worker there."""
        return self.ends.live_forwarders()

    def wait(self, refs: list, num_returns: int, timeout_s: float) -> tuple[list, list]:
        """The ranks' calls (their programs) ended so far, as `ray.wait` (driver/supervision/supervise.py)."""
        return ray.wait(refs, num_returns=num_returns, timeout=timeout_s)

    def check_nodes(self) -> RankFailedError | None:
        """The failure of the ranks whose process is ending, else of those of every node the probes
        found lost; None while all is well. A process that held GPU memory takes seconds to exit, and
        Ray reports it dead after that: its node's forwarder sees it the moment it starts to. A cut
        link or a dead machine is told within seconds, not when Ray's health checks give up on it
        (about a minute with Ray's defaults), while the ranks still wait on it in their collectives."""
        if failures := self._ends():
            return RankFailedError(failures, len(self.handles))
        lost = self.probes.tick() if self.probes is not None else {}
        if not lost:
            return None
        failures, at = [], time.time()
        for node_id, (silent_s, why) in lost.items():
            self.lost[node_id] = True
            on_node = [h for h in self.handles if h.report.node_id == node_id]
            summary = self._lost_summary(node_id, silent(silent_s, why))
            failures += [
                RankFailure(**failure_site(h), kind=FailureKind.DIED, summary=summary, at=at) for h in on_node
            ]
        return RankFailedError(failures, len(self.handles))

    def _ends(self) -> list[RankFailure]:
        """The failure of each rank found ending (EndsWatch)."""
        ended, at = self.ends.ended(), time.time()
        failures = self.ends.forwarders_died(at, self._node_gone)
        for h, e in ended:
            if e.vanished and self._exited_cleanly(h):  # os._exit(0): Ray's report tells it (`outcome`)
                continue
            if self._node_gone(h):  # its raylet died, and its workers exit with it (code 1)
                summary, code = self._lost_summary(h.report.node_id, "its raylet no longer answers"), None
            else:
                summary, code = e.describe(), e.exit_code
                self.salvaging[h.slot.rank] = self._salvage(h)
            failures.append(
                RankFailure(**failure_site(h), kind=FailureKind.DIED, summary=summary, at=at, exit_code=code)
            )
        return failures

    def pids_gone(self) -> set[int]:
        """The pids of the ranks' processes their nodes have seen end so far, looked at now."""
        self.ends.ended()
        return self.ends.seen_gone

    def close(self) -> None:
        if self.probes is not None:
            self.probes.close()

    def outcome(self, ref: Any, rank: int) -> tuple[bool, Any]:
        """(True, what the rank returned) or (False, its RankFailure)."""
        h = self.handles[rank]
        where = failure_site(h)
        try:
            out = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            if self._exited_cleanly(h):  # the program's os._exit(0): the rank's success, as under torchrun
                self.lingering[rank] = []
                return True, None
            summary = self._died(h, str(e))
            if not self.lost[h.report.node_id]:
                self.salvaging[rank] = self._salvage(h)
            return False, RankFailure(**where, kind=FailureKind.DIED, summary=summary, at=time.time())
        except ray.exceptions.RayError as e:
            return False, RankFailure(
                **where, kind=FailureKind.EXCEPTION, summary=first_line(e), traceback=str(e), at=time.time()
            )
        if out.ok:
            self.lingering[rank] = list(out.lingering)
            return True, out.value
        return False, _program_failure(h, out)

    def _node_gone(self, h: RankHandle) -> bool:
        """Whether a dead rank's node is lost (asked once per node: Ray says so only after its health
        checks, seconds later)."""
        node_id, lost = h.report.node_id, self.lost
        if node_id not in lost:
            lost[node_id] = node_lost(node_id)
        return lost[node_id]

    def _exited_cleanly(self, h: RankHandle) -> bool:
        """Whether a rank whose process died left its exit mark on the way (rank/spool.py
        `mark_os_exit_zero`), read on its node; False where that cannot be told."""
        if not h.spool or self._node_gone(h):
            return False
        return read_exit_mark(h.report.node_id, exit_mark(h.spool), self.forwarders())

    def _died(self, h: RankHandle, ray_message: str) -> str:
        """What became of a rank whose process is gone: its node lost, or the process itself."""
        if not self._node_gone(h):
            return describe_death(ray_message)
        return self._lost_summary(h.report.node_id, "its raylet no longer answers")

    def _lost_summary(self, node_id: str, how: str) -> str:
        """The failure of every rank of a lost node, however it was found lost."""
        return lost_summary([h.slot for h in self.handles if h.report.node_id == node_id], how)

    def _salvage(self, handle: RankHandle) -> Any:
        """Start shipping a dead rank's spool from its node: what its process wrote last."""
        sink = self.sink
        if sink is None or not handle.spool:
            return None
        return ship_from(handle.report.node_id, sink, spools_of([handle]), self.forwarders())

    def inspect_hang(self, idle_s: float) -> list[RankFailure]:
        """Every rank's state and stack, read on its node by the node's output forwarder (a task where
        it has none, which first waits for Ray to start a worker); one failure per rank."""
        from ...core.hang import group_stacks, hang_failures

        handles = self.handles
        log.error("no output or progress from any rank for %.0fs: reading every rank's stack", idle_s)
        by_node, forwarders = ranks_by_node(handles), self.forwarders()
        refs = {
            node: inspect_on(node, [h.report.process for h in hs], forwarders) for node, hs in by_node.items()
        }
        seen: dict[int, dict[str, Any]] = {}
        ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=INSPECT_WAIT_S)[0])
        for node, ref in refs.items():
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer within {INSPECT_WAIT_S:g}s")
                for h, found in zip(by_node[node], ray.get(ref, timeout=0), strict=True):
                    seen[h.slot.rank] = found
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.warning("could not inspect the ranks on node %s: %s", node[:8], first_line(e))
        for ranks, info in group_stacks(seen):
            which = (
                f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_rank_ranges(ranks)} ({len(ranks)})"
            )
            log.error("stack of %s (pid %s):\n%s", which, info["pid"], info["stack"].rstrip())
        return hang_failures(idle_s, [dataclasses.asdict(h.info) for h in handles], seen)

    def last_words(self, error: RankFailedError | None) -> None:
        """After an attempt ended badly: ship every rank's spool still on a live node, so the rank logs
        hold what each printed to its end; a dead rank's failure gets its last lines and, where they or
        its node tell, the signal that killed it."""
        handles, sink, salvaging, lost = self.handles, self.sink, self.salvaging, self.lost
        if sink is None or not handles:
            return
        rest = [h for h in handles if h.slot.rank not in salvaging and not lost.get(h.report.node_id)]
        by_node, forwarders = ranks_by_node(tuple(rest)), self.forwarders()
        refs = [ship_from(node, sink, spools_of(hs), forwarders) for node, hs in by_node.items()]
        # nothing from a node found lost since: it would answer nothing
        on_lost = {h.slot.rank for h in handles if lost.get(h.report.node_id)}
        pending = [r for rank, r in salvaging.items() if r is not None and rank not in on_lost] + refs
        ready = wait_shipped(pending, SALVAGE_WAIT_S)
        if error is None:
            return
        amended = []
        for f in error.failures:
            ref = salvaging.get(f.rank)
            if f.kind is not FailureKind.DIED or ref is None:
                amended.append(f)
                continue
            try:
                got = shipped(ref) if ref in ready else {}
                tail = tuple(ray.get(sink.tail.remote(f.rank), timeout=5))
            except (ray.exceptions.RayError, OSError) as e:
                log.warning("could not read what rank %d printed last: %s", f.rank, first_line(e))
                amended.append(f)
                continue
            before, after = handles[f.rank].report.oom_kills, got.get("oom_kills")
            ended = ProcessEnd(f.pid or 0, _status(f.exit_code))
            cause = death_cause(tail, after - before if None not in (before, after) else None, ended)
            summary = cause or f.summary
            amended.append(dataclasses.replace(f, summary=summary, last_output=readable_tail(tail)))
        error.amend(amended)
