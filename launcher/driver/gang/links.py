"""Before the program starts: every rank's node can reach MASTER_ADDR:MASTER_PORT.

A rank that cannot (a firewall between the nodes, an interface that routes nowhere) would sit in
torch's connect retries, a warning every few seconds, until the store times out (30 minutes under
torch.distributed's defaults). Here rank 0 listens on the port for a moment, each other node tries
it once, and a pair that cannot connect fails the launch in one line naming both nodes and their
interfaces. One probe per node: ranks of a node share its routes.
"""

from __future__ import annotations

import ray

from ...core.errors import ClusterError
from ...core.topology import RankReport, RankSlot
from ..lifecycle.stop import StopSignal
from .actors import wait_all

REACH_TIMEOUT_S = 5.0


def check_rendezvous(
    actors: list, slots: list[RankSlot], reports: list[RankReport], master: tuple[str, int], stop: StopSignal
) -> None:
    firsts: dict[str, int] = {}  # the first rank of each node but the master's (which reaches itself)
    for s in slots[1:]:
        if s.node_id != slots[0].node_id:
            firsts.setdefault(s.node_id, s.rank)
    if not firsts:
        return
    host, port = master
    ray.get(actors[0].open_rendezvous.remote(port))
    try:
        refs = {r: actors[r].reach.remote(host, port, REACH_TIMEOUT_S) for r in firsts.values()}
        wait_all(list(refs.values()), REACH_TIMEOUT_S + 30, stop)
        failed = {r: ray.get(ref) for r, ref in refs.items()}
    finally:
        ray.get(actors[0].close_rendezvous.remote())
    failed = {r: why for r, why in failed.items() if why}
    if not failed:
        return
    r, why = next(iter(sorted(failed.items())))
    me, master_report = reports[r], reports[0]
    others = f" (and {len(failed) - 1} more node(s))" if len(failed) > 1 else ""
    raise ClusterError(
        f"rank {r} on {me.node_ip} ({me.hostname}, interface {me.iface or '?'}) cannot reach the rendezvous "
        f"MASTER_ADDR:MASTER_PORT = {host}:{port} on rank 0's node ({master_report.hostname}, interface "
        f"{master_report.iface or '?'}): {why}{others}; let the nodes connect on ports 20000-29999 (or set "
        "--master-port to one they can), or run `megaray doctor --nodes N` to test every pair"
    )
