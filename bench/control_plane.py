"""Control-plane scale: placement groups, actors and env for many ranks on simulated nodes with
declared GPUs, with a target that imports nothing, through `launch()`. Reports milliseconds per
rank for each phase, and torchrun spawning as many trivial workers on this machine, in the same run.

It also reports where the CPU went, per rank: the driver and the GCS (one each per cluster, so their
cost per rank is what limits scale), the raylets, and each rank's own process (its Ray worker's
start-up plus megaray's setup; on a real cluster these run on the ranks' nodes, in parallel). On
simulated nodes every one of them shares this machine's cores.

    python bench/control_plane.py --layouts 8x8 16x8 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from common import PY, REPO, median, ray_cluster, summary, timed

PHASES = ("placed", "actors_ready", "env_set", "finished", "torn_down")
CPU_PARTS = ("driver", "gcs", "raylets", "rank process")
DAEMON_PARTS = {"gcs_server": "gcs", "raylet": "raylets"}  # process name -> part
IDLE_SAMPLE_S = 3.0


def _cpu_now() -> dict[str, float]:
    """CPU seconds used so far by this process (the driver) and by its GCS and raylets (the
    simulated cluster's)."""
    import psutil

    cpu = {"driver": time.process_time(), "gcs": 0.0, "raylets": 0.0}
    for proc in psutil.Process().children(recursive=True):
        try:
            name, t = proc.name(), proc.cpu_times()
        except psutil.Error:
            continue
        part = DAEMON_PARTS.get(name)
        if part:
            cpu[part] += t.user + t.system
    return cpu


def _used(since: dict[str, float]) -> dict[str, float]:
    return {k: v - since[k] for k, v in _cpu_now().items()}


def megaray_once(address: str, nodes: int, gpus: int) -> dict[str, float]:
    """Phase end times of one launch (seconds from its start), plus `cpu <part>` CPU seconds.

    The driver, GCS and raylets also use CPU when idle (heartbeats, resource reports, polling), in
    proportion to time rather than ranks; the rate measured over a few idle seconds just before
    the launch is taken off, so what is left is what the launch cost them.
    """
    import ray

    sys.path.insert(0, str(REPO))
    from launcher.core.launch_args import spec_from_args
    from launcher.driver.lifecycle.launch import launch

    os.chdir(REPO)
    ray.init(address=address, namespace="megaray", log_to_driver=False)
    try:
        spec = spec_from_args(["--nodes", str(nodes), "--gpus-per-node", str(gpus), "--cpus-per-rank", "0.01",
                               "--entrypoint", "bench.targets:cpu_seconds"])  # fmt: skip
        start = _cpu_now()
        time.sleep(IDLE_SAMPLE_S)
        idle = {k: v / IDLE_SAMPLE_S for k, v in _used(start).items()}
        start, t0 = _cpu_now(), time.monotonic()
        result = launch(spec)
        wall = time.monotonic() - t0
        used = _used(start)
        assert len(result.returns) == nodes * gpus
        cpu = {k: max(0.0, v - idle[k] * wall) for k, v in used.items()}
        cpu["rank process"] = sum(result.returns)
        return {**result.timings, **{f"cpu {k}": v for k, v in cpu.items()}}
    finally:
        ray.shutdown()


def torchrun_once(ranks: int) -> float:
    t0, p = timed([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   "--no-python", "true"])  # fmt: skip
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return time.time() - t0


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", nargs="+", default=["8x8", "16x8"], help="NODESxGPUS")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    results = {}
    for layout in args.layouts:
        nodes, gpus = map(int, layout.split("x"))
        ranks = nodes * gpus
        runs: list[dict[str, float]] = []
        with ray_cluster(nodes=nodes, cpus_per_node=1, gpus_per_node=gpus) as address:
            for _ in range(args.repeats):
                runs.append(megaray_once(address, nodes, gpus))
        tr = [torchrun_once(ranks) for _ in range(args.repeats)]
        results[layout] = {"megaray": runs, "torchrun": tr}
        print(f"{layout} = {ranks} ranks (ms per rank, median of {args.repeats}):", flush=True)
        prev = 0.0
        for phase in PHASES:
            at = median([r[phase] for r in runs])
            print(f"  {phase:13s} {1000 * (at - prev) / ranks:8.1f}   (phase ends at {at:.2f} s)", flush=True)
            prev = at
        cpu = "; ".join(
            f"{part} {1000 * median([r[f'cpu {part}'] for r in runs]) / ranks:.1f}" for part in CPU_PARTS
        )
        print(f"  CPU ms per rank (driver, GCS, raylets: less their idle rate): {cpu}", flush=True)
        total = [r["torn_down"] for r in runs]
        print(f"  megaray total {1000 * median(total) / ranks:8.1f} ms/rank; {summary(total)} s", flush=True)
        print(f"  torchrun (spawn {ranks} trivial workers) {1000 * median(tr) / ranks:8.1f} ms/rank; "
              f"{summary(tr)} s", flush=True)  # fmt: skip
    return results


if __name__ == "__main__":
    main()
