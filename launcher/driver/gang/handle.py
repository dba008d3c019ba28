"""What the driver knows about one rank of a launch, shared by the gang that runs the ranks
(driver/gang/gang.py) and what tells how they ended (driver/supervision/rank_ends.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.rankenv import EnvDecision
from ...core.topology import RankInfo, RankReport, RankSlot


@dataclass(frozen=True)
class RankHandle:
    """Everything the driver knows about one rank: its slot, its actor, what the actor reported, the
    env it was given, and the process it replaced (a warm spare taking over)."""

    slot: RankSlot
    actor: Any
    report: RankReport
    env: EnvDecision
    replaces_pid: int | None = None
    spool: str | None = None  # the file on its node its output goes through (rank/spool.py)

    @property
    def info(self) -> RankInfo:
        s, r = self.slot, self.report
        return RankInfo(s.rank, s.local_rank, s.node_rank, s.node_ip, r.hostname, ",".join(r.gpu_ids), r.pid)


def failure_site(h: RankHandle) -> dict[str, Any]:
    """What a RankFailure says of where the rank ran."""
    s, r = h.slot, h.report
    return {"rank": s.rank, "node_ip": s.node_ip, "hostname": r.hostname, "gpu": h.info.gpu,
            "local_rank": s.local_rank, "pid": r.pid}  # fmt: skip
