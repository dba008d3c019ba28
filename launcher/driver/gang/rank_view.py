"""What the console and the run directory say of a gang's ranks once their env is set: the topology
table (rank by rank, or node by node for a large job), rank 0's env with the notes about changed node
values, and env.json's records."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from ...core.rankenv import redact
from ...core.shellenv import startup_not_forwarded
from ...core.spec import LaunchSpec
from ...core.topology import RankInfo, format_rank_ranges, format_table
from .handle import RankHandle

log = logging.getLogger("megaray")


def env_records(handles: tuple[RankHandle, ...], envs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """env.json: what megaray set on each rank, its notes, and the whole env its process had."""
    return [
        {"rank": h.slot.rank, "set_by_megaray": redact(h.env.to_set), "notes": h.env.notes,
         "process": redact(env)}
        for h, env in zip(handles, envs, strict=True)
    ]  # fmt: skip


TABLE_MAX_RANKS = 64  # a topology up to this size is shown rank by rank; a larger one, by node
TABLE_END_NODES = 4  # nodes shown at each end of a larger one


def log_topology(ranks: tuple[RankInfo, ...], master: tuple[str, int]) -> None:
    """The ranks' table, on one screen: rank by rank for a small job; node by node, the first and
    last few, for a large one (topology.json in the run directory has every rank)."""
    head = f"topology (MASTER_ADDR={master[0]} MASTER_PORT={master[1]})"
    if len(ranks) <= TABLE_MAX_RANKS:
        rows = [("rank", "node", "ip", "host", "local_rank", "gpu", "pid")]
        rows += [
            (
                str(r.rank),
                str(r.node_rank),
                r.node_ip,
                r.hostname,
                str(r.local_rank),
                r.gpu or "-",
                str(r.pid),
            )
            for r in ranks
        ]
        log.info("%s:\n%s", head, format_table(rows, "  "))
        return
    nodes: dict[int, list[RankInfo]] = {}
    for r in ranks:
        nodes.setdefault(r.node_rank, []).append(r)
    order = sorted(nodes)
    ends = TABLE_END_NODES
    shown = order if len(order) <= 2 * ends else [*order[:ends], *order[-ends:]]
    rows = [("ranks", "node", "ip", "host")]
    for i, n in enumerate(shown):
        if i == ends and len(shown) < len(order):
            rows.append(("...", f"{len(order) - len(shown)} more nodes", "", ""))
        on = nodes[n]
        rows.append((format_rank_ranges([r.rank for r in on]), str(n), on[0].node_ip, on[0].hostname))
    log.info(
        "%s, %d ranks on %d nodes (every rank in topology.json):\n%s",
        head, len(ranks), len(order), format_table(rows, "  "),
    )  # fmt: skip


def log_env(handles: tuple[RankHandle, ...], spec: LaunchSpec, profile: Mapping[str, str]) -> None:
    """Rank 0's env, then each note about a node value that was changed, with the ranks it concerns.
    Values given with --env are never printed, and the shell's forwarded variables are left out (the
    launch named them): the console ends up in job logs. A start-up variable of the shell that the
    ranks' processes lack is told once, with how to forward it (core/shellenv.py)."""
    shell = {k for k, _ in spec.forwarded} - set(spec.env_overrides)
    first = {k: ("<not shown>" if k in spec.env_overrides else v)
             for k, v in redact(handles[0].env.to_set).items() if k not in shell}  # fmt: skip
    log.info("env of rank 0: %s", " ".join(f"{k}={v}" for k, v in sorted(first.items())))
    given = {**profile, **spec.env_overrides}
    missed = startup_not_forwarded(os.environ, handles[0].report.inherited_env, given)
    if missed:
        log.info(
            "not forwarded from this shell: %s (start-up variables, which a process must start with: "
            "--env NAME forwards one, and starts the ranks' processes with it)", ", ".join(missed),
        )  # fmt: skip
    notes: dict[str, list[int]] = {}
    for h in handles:
        for note in h.env.notes:
            notes.setdefault(note, []).append(h.slot.rank)
    for note, ranks in notes.items():
        log.warning("env on rank(s) %s: %s", format_rank_ranges(ranks), note)
