"""Pure functions that decide who is rank what: node order, rank numbering, GPU visibility, ports.

Rank order must be the same on every launch of the same cluster, and must follow node order, or
tensor-parallel groups straddle nodes and step time grows (a string sort puts 10.0.0.10 before
10.0.0.9). Nothing here talks to Ray, so all of it is tested without processes.
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from .deaths import RecordedProcess


@dataclass(frozen=True)
class NodeSlot:
    """One placement group (one node's share of the job) and where Ray put its bundle 0."""

    group: int  # index of the placement group, in creation order
    node_ip: str
    node_id: str
    hostname: str = ""


@dataclass(frozen=True)
class RankReport:
    """What a rank's actor reports once started: where it landed and what it runs on."""

    rank: int
    node_ip: str
    node_id: str
    hostname: str
    pid: int
    gpu_ids: tuple[str, ...]
    ray_version: str
    python_version: str
    inherited_env: dict[str, str]
    iface: str | None = None  # the node's interface that holds node_ip
    log_dir: str = ""  # where the node keeps worker output (rank/spool.py)
    oom_kills: int | None = None  # the node's OOM-killer count when the rank started
    gpu_memory_gib: float | None = None  # the node's smallest GPU, from NVML (None: no GPU or NVML)
    started: int | None = None  # the rank process's start time, in clock ticks after boot

    @property
    def process(self) -> RecordedProcess:
        """The rank's process, as recorded: what megaray signals on its node (a reused pid is not it)."""
        return RecordedProcess(self.pid, self.started)


@dataclass(frozen=True)
class RankSlot:
    """Where one rank lives: its numbers in the torchrun contract and its Ray bundle."""

    rank: int
    local_rank: int
    node_rank: int
    group: int  # placement group index
    bundle: int  # bundle index inside that group
    node_ip: str
    node_id: str
    hostname: str = ""


def ip_sort_key(ip: str, node_id: str) -> tuple:
    """Numeric IP order (IPv4 before IPv6, then by value); host names after addresses, by name.

    Ties (several simulated nodes on one machine share an IP) are broken by node id, so the order
    is still deterministic.
    """
    try:
        addr = ipaddress.ip_address(ip)
        return (0, addr.version, int(addr), "", node_id)
    except ValueError:
        return (1, 0, 0, ip, node_id)


def order_nodes(nodes: Iterable[NodeSlot]) -> list[NodeSlot]:
    """Nodes in rank order: the first one hosts rank 0 and gives MASTER_ADDR."""
    return sorted(nodes, key=lambda n: ip_sort_key(n.node_ip, n.node_id))


def renumbered(nodes: list[NodeSlot]) -> list[NodeSlot]:
    """`nodes` as the groups of a list that holds theirs alone, in this order (some groups dropped):
    each one's `group` becomes its position."""
    return [replace(n, group=i) for i, n in enumerate(nodes)]


def assign_ranks(ordered: list[NodeSlot], gpus_per_node: int) -> list[RankSlot]:
    """Rank = node_rank * gpus_per_node + bundle index, so each node holds a contiguous block."""
    return [
        RankSlot(
            rank=node_rank * gpus_per_node + b,
            local_rank=b,
            node_rank=node_rank,
            group=node.group,
            bundle=b,
            node_ip=node.node_ip,
            node_id=node.node_id,
            hostname=node.hostname,
        )
        for node_rank, node in enumerate(ordered)
        for b in range(gpus_per_node)
    ]


def visible_devices(gpu_ids_by_local_rank: list[list[str]]) -> str:
    """CUDA_VISIBLE_DEVICES for every rank of one node: the node's job GPUs in local-rank order.

    Ray gives each rank's actor exactly one GPU id. Listing all of the node's job GPUs (not only
    the rank's own) keeps peer access between ranks of the node (CUDA IPC, NVLink, NVLS) working;
    listing them in local-rank order makes `torch.cuda.set_device(LOCAL_RANK)` select the very GPU
    Ray assigned to that rank, even when the ids are not 0..G-1 or not in bundle order. Every rank
    of the node gets the same string. Ranks without a GPU (CPU mode) get an empty string.
    """
    flat: list[str] = []
    for local_rank, ids in enumerate(gpu_ids_by_local_rank):
        if len(ids) > 1:
            raise ValueError(f"local rank {local_rank} was given {len(ids)} GPUs ({ids}); expected one")
        flat.extend(ids)
    if flat and len(flat) != len(gpu_ids_by_local_rank):
        raise ValueError(
            f"{len(gpu_ids_by_local_rank) - len(flat)} of {len(gpu_ids_by_local_rank)} ranks on one node "
            "have no GPU id while the others have one"
        )
    if len(set(flat)) != len(flat):
        raise ValueError(f"two ranks of one node were given the same GPU: {flat}")
    return ",".join(flat)


# Ports for MASTER_PORT: below Linux's default ephemeral range (32768-60999), so the kernel does not
# hand the chosen port to some outgoing connection between our check and the rendezvous binding it,
# and above Ray's default worker ports (10002-19999).
PORT_RANGE = (20000, 30000)


def candidate_ports(
    seed: str,
    lo: int = PORT_RANGE[0],
    hi: int = PORT_RANGE[1],
    exclude: tuple[int, int] | None = None,
) -> Iterator[int]:
    """Every port of [lo, hi) once, in an order drawn from the job name.

    Two jobs starting together draw different orders, so they rarely probe the same port first;
    the reservation in Ray's GCS (see ports.py) settles the rest. `exclude` is the node's ephemeral
    range, read from /proc/sys/net/ipv4/ip_local_port_range.
    """
    ports = [p for p in range(lo, hi) if exclude is None or not exclude[0] <= p <= exclude[1]]
    random.Random(seed).shuffle(ports)
    yield from ports


def format_rank_ranges(ranks: Iterable[int]) -> str:
    """`[0, 1, 2, 5]` -> `0-2,5`, for messages about many ranks."""
    rs = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def format_table(rows: list[tuple[str, ...]], indent: str = "") -> str:
    """Rows of strings as left-aligned columns (the topology, doctor's tables, `megaray list`)."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join(
        indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def parse_rank_list(text: str, world_size: int) -> frozenset[int]:
    """`--log-ranks`: "all", or ranks and ranges such as "0,3,8-11"."""
    if text.strip().lower() == "all":
        return frozenset(range(world_size))
    parts, wrong = [], []
    for part in text.split(","):  # every part is read, and every wrong one named, in one line
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            wrong.append(f"{part.strip()!r} is not a rank or a range such as 8-11")
        elif sep and int(hi) < int(lo):
            wrong.append(f"the range {part.strip()} runs backwards (write {hi}-{lo})")
        else:
            parts.append((int(lo), int(hi) if sep else int(lo)))
    if wrong:
        raise ValueError(f"--log-ranks {text!r}: {'; '.join(wrong)}")
    ranks: set[int] = set()
    for first, last in parts:
        if last >= world_size:
            raise ValueError(
                f"--log-ranks {text!r} names rank {last}, but the world has {world_size} rank(s)"
            )
        ranks.update(range(first, last + 1))
    return frozenset(ranks)


# A Ray megaray starts on this machine (a local run, simulated nodes, `megaray up`) holds every CPU
# rank as a process here, a Python with torch each: more than this many only thrash the machine (100000
# asked for started a head that spun at full CPU and ignored Ctrl-C).
LOCAL_RANKS_PER_CPU = 8
LOCAL_RANKS_MIN = 32


def local_gpus_problem(world_size: int, gpus: int) -> str | None:
    """Why `world_size` GPU ranks cannot run on a Ray started on this machine, which would declare
    `gpus` GPUs, or None: said before starting one (Ray's start and a placement wait, otherwise)."""
    if world_size <= gpus:
        return None
    has = "no GPU" if gpus == 0 else f"only {gpus} GPU(s)"
    return (
        f"{world_size} GPU rank(s) asked, and this machine has {has} for a local Ray: --device cpu runs "
        "the ranks on CPUs (gloo), or attach to a cluster with GPUs with --address"
    )


def local_ranks_problem(world_size: int, cpus: int) -> str | None:
    """Why `world_size` CPU ranks are too many for this machine, or None."""
    limit = max(LOCAL_RANKS_MIN, LOCAL_RANKS_PER_CPU * cpus)
    if world_size <= limit:
        return None
    return (
        f"{world_size} CPU ranks would be {world_size} processes on this machine ({cpus} CPUs), which holds "
        f"at most {limit} ({LOCAL_RANKS_PER_CPU} per CPU): lower --nodes / --gpus-per-node, or attach to a "
        "cluster with --address"
    )


@dataclass(frozen=True)
class RankInfo:
    """Where a rank ran, as `LaunchResult.ranks` and `topology.json` show it."""

    rank: int
    local_rank: int
    node_rank: int
    node_ip: str
    hostname: str
    gpu: str
    pid: int
