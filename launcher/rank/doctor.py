"""What `megaray doctor` runs on the cluster: a probe task on each node, and the all-reduce sweep on
every rank of the layout (through the normal launch path, as `--entrypoint
launcher.rank.doctor:allreduce_bandwidth`)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..core.versions import python_version


def probe_node() -> dict[str, Any]:
    """What this node has: versions, GPUs (nvidia-smi), RDMA devices by driver, free disk."""
    import ray

    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "node_ip": ray.util.get_node_ip_address(),
        "ray_version": ray.__version__,
        "python_version": python_version(),
        "gpus": [],
        "driver_version": None,
        "cuda_version": None,
        "rdma": {},
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            q = subprocess.run(
                [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            rows = [r.split(",") for r in q.stdout.strip().splitlines() if r.strip()]
            info["gpus"] = [r[0].strip() for r in rows]
            info["driver_version"] = rows[0][1].strip() if rows else None
            head = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
            if m := re.search(r"CUDA Version:\s*([\d.]+)", head):
                info["cuda_version"] = m.group(1)
        except (OSError, subprocess.SubprocessError) as e:
            info["smi_error"] = str(e)
    ib = Path("/sys/class/infiniband")
    if ib.is_dir():
        for dev in sorted(ib.iterdir()):
            driver = dev / "device" / "driver"
            info["rdma"][dev.name] = os.path.basename(os.readlink(driver)) if driver.is_symlink() else "?"
    usage = shutil.disk_usage(tempfile.gettempdir())
    info["disk_free_gb"] = round(usage.free / 2**30, 1)
    info["disk_path"] = tempfile.gettempdir()
    return info


def bus_bandwidth(size_bytes: int, seconds: float, world: int) -> float:
    """All-reduce bus bandwidth in GB/s, as nccl-tests defines it: algbw x 2(n-1)/n."""
    if world < 2 or seconds <= 0:
        return 0.0
    return size_bytes / seconds * 2 * (world - 1) / world / 1e9


def allreduce_bandwidth() -> dict[str, Any]:
    """Time all-reduces of growing size over all ranks, then within each node."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    use_nccl = torch.cuda.is_available() and bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if use_nccl:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda") if use_nccl else torch.device("cpu")
    dist.init_process_group("nccl" if use_nccl else "gloo")
    exponents = range(10, 29, 2) if use_nccl else range(10, 23, 4)
    iters = 20 if use_nccl else 5

    def timed(size: int, group=None) -> float:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(2):
            dist.all_reduce(x, group=group)
        if use_nccl:
            torch.cuda.synchronize()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x, group=group)
        if use_nccl:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters

    sweep = [(1 << e, timed(1 << e)) for e in exponents]
    node_groups = [
        dist.new_group(list(range(n * local_world, (n + 1) * local_world)))
        for n in range(world // local_world)
    ]
    node_rank = rank // local_world
    largest = 1 << exponents[-1]
    node_time = timed(largest, node_groups[node_rank]) if local_world > 1 else 0.0
    dist.barrier()
    dist.destroy_process_group()
    return {
        "rank": rank,
        "backend": "nccl" if use_nccl else "gloo",
        "backend_version": ".".join(map(str, torch.cuda.nccl.version())) if use_nccl else torch.__version__,
        "sweep": sweep,
        "node_rank": node_rank,
        "node_busbw": bus_bandwidth(largest, node_time, local_world),
        "largest": largest,
    }
