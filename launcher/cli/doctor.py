"""`megaray doctor`: is this cluster ready for the layout, and how fast is its all-reduce?

What breaks multi-node runs is mostly visible before training: a node on another Ray or Python,
a node with fewer GPUs than the others, an EFA or InfiniBand device missing where the env
profile expects one, a full disk, a slow link. Each node is probed by a task pinned to it; then
the requested layout runs an all-reduce sweep through the normal launch path (NCCL on GPUs, gloo
on CPU) and reports bus bandwidth per message size, and per node.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..core.args import ArgumentParser
from ..core.errors import UsageError
from ..core.topology import format_table, ip_sort_key
from ..core.versions import python_version
from ..rank.doctor import bus_bandwidth, probe_node

log = logging.getLogger("megaray")

MIN_FREE_DISK_GB = 10.0
MATRIX_NODES = 16  # up to this many nodes, every pair's link is checked and shown as a matrix


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="megaray doctor", description=__doc__.splitlines()[0])
    p.add_argument("--address", help="Ray cluster (default RAY_ADDRESS)")
    p.add_argument(
        "--nodes", type=int, help="nodes the launch will use (with --gpus-per-node: all-reduce test)"
    )
    p.add_argument(
        "--gpus-per-node", "--nproc-per-node", dest="gpus_per_node", type=int,
        help="ranks per node the launch will use: each node must hold that many GPUs",
    )  # fmt: skip
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="the launch's device (gpu)")
    p.add_argument("--env-profile", help="the profile the launch will use: its network devices are checked")
    p.add_argument(
        "--all-links", action="store_true",
        help=f"check every pair of nodes (the default above {MATRIX_NODES} nodes: each node to the next "
        "two and the one halfway round, a number of probes that grows with the nodes, not their square)",
    )  # fmt: skip
    return p


def link_targets(n: int, every_pair: bool) -> list[list[int]]:
    """Which nodes each of `n` nodes connects to: every other one, or at scale its next two round the
    ring and the one halfway, which crosses any split of the nodes into two groups that cannot reach
    each other, in 3n probes instead of n(n-1) (1,047,552 at 1,024 nodes)."""
    if every_pair or n <= MATRIX_NODES:
        return [[j for j in range(n) if j != i] for i in range(n)]
    return [sorted({(i + k) % n for k in (1, 2, n // 2)}) for i in range(n)]


# -- the checks (pure) -----------------------------------------------------------------------------


@dataclass
class NodeReport:
    info: dict[str, Any]
    declared_gpus: int
    problems: list[str] = field(default_factory=list)  # fail the doctor
    warnings: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return "FAIL" if self.problems else "WARN" if self.warnings else "ok"


def profile_needs(profile: dict[str, str]) -> str | None:
    if profile.get("FI_PROVIDER") == "efa":
        return "efa"
    if profile.get("NCCL_IB_DISABLE") == "0":
        return "infiniband"
    return None


def check_nodes(
    nodes: list[tuple[dict[str, Any], int]],
    want: tuple[str, str],
    gpus_per_node: int | None,
    device: str,
    needs: str | None,
) -> list[NodeReport]:
    """One report per node. `nodes` holds (probe result, GPUs Ray declares); `want` the driver's
    Ray and Python versions."""
    reports = []
    types = {tuple(sorted(set(i["gpus"]))) for i, _ in nodes if i["gpus"]}
    for info, declared in nodes:
        r = NodeReport(info, declared)
        got = (info["ray_version"], info["python_version"])
        if got != want:
            r.problems.append(f"Ray {got[0]}, Python {got[1]} (driver: Ray {want[0]}, Python {want[1]})")
        physical = len(info["gpus"])
        if info["gpus"] and physical < declared:
            r.problems.append(f"Ray declares {declared} GPUs, nvidia-smi sees {physical}")
        if device == "gpu" and gpus_per_node and 0 < declared < gpus_per_node:
            r.warnings.append(
                f"{declared} GPU(s), fewer than --gpus-per-node {gpus_per_node}: no ranks go here"
            )
        if device == "gpu" and declared and not info["gpus"]:
            r.warnings.append("GPUs declared but no nvidia-smi (simulated, or no driver)")
        if len(types) > 1 and info["gpus"]:
            r.warnings.append(
                f"GPU types differ between nodes: {', '.join('/'.join(t) for t in sorted(types))}"
            )
        drivers = set(info["rdma"].values())
        if needs == "efa" and "efa" not in drivers and (declared or device == "cpu"):
            r.problems.append("the env profile uses EFA but the node has no EFA device")
        if needs == "infiniband" and not (drivers - {"efa"}) and (declared or device == "cpu"):
            r.problems.append("the env profile uses InfiniBand but the node has no IB/RoCE device")
        if info["disk_free_gb"] < MIN_FREE_DISK_GB:
            r.warnings.append(f"only {info['disk_free_gb']} GiB free in {info['disk_path']}")
        reports.append(r)
    return reports


def layout_problem(reports: list[NodeReport], nodes: int, gpus_per_node: int, device: str) -> str | None:
    if device == "cpu":
        return None
    fit = [r for r in reports if r.declared_gpus >= gpus_per_node]
    if len(fit) < nodes:
        return (
            f"--nodes {nodes} --gpus-per-node {gpus_per_node} does not fit: {len(fit)} node(s) have "
            f"{gpus_per_node} or more GPUs"
        )
    return None


def slow_nodes(per_node: dict[int, float]) -> list[int]:
    """Nodes whose intra-node bus bandwidth is under half the median of the nodes."""
    if len(per_node) < 2:
        return []
    median = statistics.median(per_node.values())
    return sorted(n for n, bw in per_node.items() if bw < 0.5 * median)


def link_matrix(
    ips: list[str], ifaces: list[str | None], results: list[list[str | None]]
) -> tuple[str, list[str]]:
    """The table of which node reached which (row: from, column: to), and a line per pair that did
    not. `results[i][j]` is None when node i reached node j (the diagonal is not probed)."""
    rows = [("from \\ to", "interface", *(str(j) for j in range(len(ips))))]
    failed = []
    for i, ip in enumerate(ips):
        cells = []
        for j in range(len(ips)):
            why = None if i == j else results[i][j]
            cells.append("-" if i == j else "ok" if why is None else "FAIL")
            if i != j and why is not None:
                failed.append(link_failure(ips, ifaces, i, j, why))
        rows.append((f"{i} {ip}", ifaces[i] or "?", *cells))
    return format_table(rows, "  "), failed


def link_failure(ips: list[str], ifaces: list[str | None], i: int, j: int, why: str) -> str:
    to = f"node {j} ({ips[j]}, {ifaces[j] or '?'})"
    return f"node {i} ({ips[i]}, {ifaces[i] or '?'}) cannot reach {to} on the rendezvous ports: {why}"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


# -- the command -----------------------------------------------------------------------------------


def main(argv: list[str], exits_after: bool = False) -> int:
    args = build_parser().parse_args(argv)
    if (args.nodes is None) != (args.gpus_per_node is None):
        raise UsageError("give --nodes and --gpus-per-node together (the layout of the all-reduce test)")
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    profile: dict[str, str] = {}
    if args.env_profile:
        from ..core.profiles import load_profile

        profile = load_profile(args.env_profile)
    address = args.address or os.environ.get("RAY_ADDRESS")
    import ray

    from ..driver.cluster import up

    if not address and not ray.is_initialized() and up.running() is None:  # the launches' "which Ray"
        raise UsageError(
            "doctor checks a running cluster: pass --address HEAD:6379, set RAY_ADDRESS, or start one on "
            "this machine with `megaray up`"
        )
    from ..core.spec import LaunchSpec
    from ..core.target import DRY_RUN_TARGET
    from ..driver.cluster.cluster import connect

    probe_spec = LaunchSpec(
        nodes=1, gpus_per_node=1, target=DRY_RUN_TARGET, dry_run=True, address=address, job_name="doctor"
    )
    with connect(probe_spec, exits_after=exits_after):
        reports = _probe_all(args, profile)
        ok = _print_nodes(reports) & _links(every_pair=args.all_links)
        if args.nodes is None:
            log.info("all-reduce test skipped: pass --nodes and --gpus-per-node to run it over that layout")
            return 0 if ok else 1
        problem = layout_problem(reports, args.nodes, args.gpus_per_node, args.device)
        if problem:
            log.error("%s; all-reduce test skipped", problem)
            return 1
        return 0 if _bandwidth(args, address) and ok else 1


def _probe_all(args: argparse.Namespace, profile: dict[str, str]) -> list[NodeReport]:
    import ray

    from ..driver.gang.actors import on_node

    alive = sorted(
        (n for n in ray.nodes() if n["Alive"]),
        key=lambda n: ip_sort_key(n["NodeManagerAddress"], n["NodeID"]),
    )
    task = ray.remote(probe_node)
    refs = [task.options(**on_node(n["NodeID"])).remote() for n in alive]
    infos = ray.get(refs, timeout=120)
    want = (ray.__version__, python_version())
    declared = [int(n["Resources"].get("GPU", 0)) for n in alive]
    return check_nodes(
        list(zip(infos, declared, strict=True)), want, args.gpus_per_node, args.device, profile_needs(profile)
    )


def _links(every_pair: bool, timeout_s: float = 3.0) -> bool:
    """Every node tries to connect to every other (at scale, to a few: `link_targets`) on a port of
    the rendezvous range (20000-29999), from where ranks would: gloo and NCCL connect every pair, not
    only to rank 0."""
    import ray

    from ..driver.gang.actors import kill_actors, on_node
    from ..rank.links import LinkProbe

    alive = sorted(
        (n for n in ray.nodes() if n["Alive"]),
        key=lambda n: ip_sort_key(n["NodeManagerAddress"], n["NodeID"]),
    )
    if len(alive) < 2:
        return True
    ips = [n["NodeManagerAddress"] for n in alive]
    probes = [
        ray.remote(LinkProbe).options(**on_node(n["NodeID"])).remote(ip)
        for n, ip in zip(alive, ips, strict=True)
    ]
    try:
        listening = ray.get([p.listen.remote(f"doctor-{i}") for i, p in enumerate(probes)], timeout=60)
        targets = [(ip, port) for ip, (port, _) in zip(ips, listening, strict=True)]
        plan = link_targets(len(ips), every_pair)
        refs = [p.reach_all.remote([targets[j] for j in plan[i]], timeout_s) for i, p in enumerate(probes)]
        answers = ray.get(refs, timeout=timeout_s * max(map(len, plan)) + 60)
        ray.get([p.close.remote() for p in probes], timeout=30)
    finally:
        kill_actors(probes)
    ifaces = [iface for _, iface in listening]
    pairs, every = sum(map(len, plan)), len(ips) * (len(ips) - 1)
    if pairs == every:
        results: list[list[str | None]] = [[None] * len(ips) for _ in ips]
        for i, row in enumerate(answers):
            for j, why in zip(plan[i], row, strict=True):
                results[i][j] = why
        table, failed = link_matrix(ips, ifaces, results)
        print(f"links between nodes (TCP, rendezvous port range):\n{table}", flush=True)
    else:
        failed = [
            link_failure(ips, ifaces, i, j, why)
            for i, row in enumerate(answers)
            for j, why in zip(plan[i], row, strict=True)
            if why is not None
        ]
        print(
            f"links between nodes (TCP, rendezvous port range): {pairs - len(failed)} of {pairs} pairs "
            f"checked connect (each node to the next two and the one halfway round; --all-links checks "
            f"all {every})", flush=True,
        )  # fmt: skip
    for line in failed:
        log.error("%s", line)
    return not failed


def _print_nodes(reports: list[NodeReport]) -> bool:
    rows = [("node", "ip", "host", "ray", "python", "gpus (ray)", "gpus (nvidia-smi)", "driver/cuda", "rdma",
             "disk free", "status")]  # fmt: skip
    for i, r in enumerate(reports):
        info = r.info
        gpus = info["gpus"]
        kinds = ", ".join(f"{gpus.count(k)}x {k}" for k in sorted(set(gpus))) if gpus else "-"
        rdma = ",".join(f"{d}({drv})" for d, drv in info["rdma"].items()) or "-"
        rows.append(
            (
                str(i), info["node_ip"], info["hostname"], info["ray_version"], info["python_version"],
                str(r.declared_gpus), kinds, f"{info['driver_version'] or '-'}/{info['cuda_version'] or '-'}",
                rdma, f"{info['disk_free_gb']} GiB", r.status,
            )
        )  # fmt: skip
    print(f"nodes ({len(reports)}):\n{format_table(rows, '  ')}", flush=True)
    for i, r in enumerate(reports):
        for p in r.problems:
            log.error("node %d (%s): %s", i, r.info["node_ip"], p)
        for w in r.warnings:
            log.warning("node %d (%s): %s", i, r.info["node_ip"], w)
    return not any(r.problems for r in reports)


def _bandwidth(args: argparse.Namespace, address: str | None) -> bool:
    from ..core.errors import MegarayError
    from ..core.launch_args import spec_from_args
    from ..driver.lifecycle.launch import launch

    argv = ["--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus_per_node), "--device", args.device]
    argv += ["--runs-dir", tempfile.mkdtemp(prefix="megaray-doctor-"), "--placement-timeout", "60"]
    argv += [
        *(["--address", address] if address else []),
        "--entrypoint",
        "launcher.rank.doctor:allreduce_bandwidth",
    ]
    if args.env_profile:
        argv += ["--env-profile", args.env_profile]
    try:
        result = launch(spec_from_args(argv))
    except MegarayError as e:
        log.error("all-reduce test failed: %s", e)
        return False
    first = result.returns[0]
    world = result.world_size
    rows = [("size", "time", "bus bandwidth")]
    for size, seconds in first["sweep"]:
        rows.append(
            (_size(size), f"{seconds * 1e3:.3f} ms", f"{bus_bandwidth(size, seconds, world):.3f} GB/s")
        )
    version = f"{first['backend']} {first['backend_version']}" if first["backend"] == "nccl" else "gloo"
    print(f"all-reduce over {world} ranks ({version}):\n{format_table(rows, '  ')}", flush=True)
    per_node = {
        r["node_rank"]: r["node_busbw"] for r in result.returns if r["rank"] % args.gpus_per_node == 0
    }
    if args.gpus_per_node > 1:
        slow = slow_nodes(per_node)
        rows = [("node", "ip", f"bus bandwidth within the node ({_size(first['largest'])})", "")]
        ips = {r.node_rank: r.node_ip for r in result.ranks}
        for n, bw in sorted(per_node.items()):
            rows.append(
                (str(n), ips[n], f"{bw:.3f} GB/s", "SLOW: under half the median" if n in slow else "")
            )
        print(f"per node:\n{format_table(rows, '  ')}", flush=True)
        if slow:
            log.error("slow node(s): %s", ", ".join(f"{n} ({ips[n]})" for n in slow))
            return False
    return True
