"""Whether a node of the job still answers, decided from megaray's own probes
(driver/supervision/liveness.py), not Ray's health checks: with Ray's defaults a node whose link is cut is
declared dead after about 60 s (5 checks, 10 s timeout each), on a cluster the user often did not start and
cannot retune.

A probe is a TCP connection to the node's raylet port: the kernel answers it whatever the raylet or
the ranks are doing (a node at 100% CPU, a rank in a 60 s C call, a long checkpoint write, a stopped
process), so only a node or link that is gone misses it. A node is lost after `misses` probes in a
row went unanswered (timed out or refused) and none succeeded for `after_s`. A node that never
answered is never lost by this rule (a firewall may keep the driver from its raylet's port while Ray
works): it is left to Ray's health checks, and said once (`unprobed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY_S = 1.0
MAX_PROBES_PER_S = 2000  # the driver's cost, about 0.1 ms of CPU a probe: above 2,000 nodes, less often
PROBE_TIMEOUT_S = 1.0
LOST_AFTER_MISSES = 3
LOST_AFTER_S = 4.0


def probe_every(nodes: int) -> float:
    """Seconds between two probes of a node: each second up to 2,000 nodes, then so that the driver
    sends 2,000 a second (4,096 nodes: every 2 s; a lost node is then told in about 8 s, not 5)."""
    return max(PROBE_EVERY_S, nodes / MAX_PROBES_PER_S)


@dataclass
class _Node:
    last_ok: float
    misses: int = 0
    why: str = ""
    answered: bool = False


@dataclass
class Liveness:
    """The probes' results per node, and which nodes they say are lost (pure: the caller's clock)."""

    nodes: list[str]
    started: float
    misses: int = LOST_AFTER_MISSES
    after_s: float = LOST_AFTER_S
    _seen: dict[str, _Node] = field(default_factory=dict)

    def __post_init__(self):
        if self.misses < 1 or self.after_s <= 0:
            raise ValueError(
                f"a node is lost after 1 miss or more and some time, got {self.misses}, {self.after_s}"
            )
        self._seen = {n: _Node(self.started) for n in self.nodes}

    def answered(self, node: str, now: float) -> None:
        self._seen[node] = _Node(now, answered=True)

    def missed(self, node: str, why: str) -> None:
        seen = self._seen[node]
        seen.misses += 1
        seen.why = why

    def lost(self, now: float) -> dict[str, tuple[float, str]]:
        """node -> (seconds since it last answered, what the last probe met), for the lost ones."""
        return {
            n: (now - s.last_ok, s.why)
            for n, s in self._seen.items()
            if s.answered and s.misses >= self.misses and now - s.last_ok >= self.after_s
        }

    def unprobed(self) -> dict[str, str]:
        """node -> what its probes met, for the nodes that never answered one after `misses` tries."""
        return {n: s.why for n, s in self._seen.items() if not s.answered and s.misses >= self.misses}
