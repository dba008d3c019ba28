"""Failure detection and teardown: a killed rank, a lost node, a hung (SIGSTOPped) rank.

For each, the time from the event to every rank process gone with the job's placement groups
removed, and to the driver's exit, on a simulated cluster (2 nodes x 1 CPU rank). Node loss is
detected by Ray's health checks, set here as the README shows (period 500 ms, 3 misses); a hang by
--hang-timeout, which is subtracted so what is left is megaray's own delay (stack reading included).
torchrun has no counterpart for those two: a lost node or a hung rank waits for NCCL's watchdog
(10 minutes by default). Last, restart speed: with --max-restarts 1, from a rank's SIGKILL to the
first training step after the relaunch, on warm spares (the default) and cold (--no-spares), with
the Megatron dry-run trainer (megatron-core GPT, checkpoint every step) or, with --trainer loop, to
every relaunched rank past init_process_group.

    python bench/failures.py --repeats 3 --hang-timeout 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common import PY, REPO, clean_env, summary

HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
# Ranks that train as a job would: a collective and a line of output every 0.1 s, so one stopped
# rank leaves its peer blocked in the all-reduce and the whole job silent.
LOOP = """
import os, sys, time
import torch, torch.distributed as dist
from launcher.progress import report
dist.init_process_group("gloo")
open(os.path.join(sys.argv[1], f"pid-{dist.get_rank()}"), "w").write(str(os.getpid()))
step = 0
while True:
    t = torch.ones(1)
    dist.all_reduce(t)
    print("step", flush=True)
    step += 1
    report(step)
    time.sleep(0.1)
"""
RESTARTS = ("restart", "restart cold")
# The relaunched trainer's first step: the dry run resumes, then saves after its first step.
FIRST_STEP = re.compile(r"resumed from checkpoint at iteration \d+\n[\s\S]*saved checkpoint")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def _wait(what: str, ready, p: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: the job ended or stalled")
        time.sleep(0.02)


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def once(cluster, scenario: str, job: str, hang_timeout: float, trainer: str) -> tuple[float, float]:
    import ray

    runs = Path(tempfile.mkdtemp(prefix="megaray-failures-"))
    (runs / "loop.py").write_text(LOOP)
    hang = hang_timeout if scenario == "hang" else 0
    megatron = scenario in RESTARTS and trainer == "megatron"
    cmd = [PY, str(REPO / "main.py"), "--address", cluster.address, "--job-name", job, "--device", "cpu",
           "--nodes", "2", "--gpus-per-node", "1", "--runs-dir", str(runs), "--hang-timeout", str(hang),
           "--max-restarts", str(int(scenario in RESTARTS)),
           "--spares" if scenario == "restart" else "--no-spares"]  # fmt: skip
    if megatron:
        cmd += ["--dry-run", "steps=1000000", f"save={runs / 'ckpt'}", "save_every=1"]
    else:
        cmd += [str(runs / "loop.py"), str(runs)]
    driver_out = runs / "driver.out"
    with driver_out.open("w") as sink:
        p = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=sink, stderr=subprocess.STDOUT)
    try:
        topo = runs / job / "topology.json"
        log0 = runs / job / "rank-0.log"
        if megatron:
            _wait(scenario, lambda: topo.exists() and "saved checkpoint at iteration 2" in _text(log0), p)
        else:
            _wait(scenario, lambda: topo.exists() and len(list(runs.glob("pid-*"))) == 2, p, 120)
        if scenario == "restart":  # kill a rank once the spares are ready, as in a long run
            _wait("spares", lambda: "warm spare(s) ready" in _text(driver_out), p)
        while scenario == "hang" and not (log0.exists() and "step" in log0.read_text()):
            time.sleep(0.02)  # stop a rank only once the job has printed: the hang clock is running
        time.sleep(0.5 if scenario == "hang" else 0)
        ranks = json.loads(topo.read_text())["ranks"]
        pids = [r["pid"] for r in ranks]
        t0 = time.monotonic()
        if scenario in RESTARTS:  # to the relaunch's first step (or ranks past init), then stop
            os.kill(pids[1], signal.SIGKILL)
            if megatron:
                _wait(scenario, lambda: FIRST_STEP.search(_text(log0)) is not None, p, 300)
            else:
                first = (runs / "pid-0").read_text()
                _wait(scenario, lambda: (runs / "pid-0").read_text() not in ("", first), p, 120)
            took = time.monotonic() - t0
            p.send_signal(signal.SIGINT)
            p.wait(60)
            # the relaunch's own phases (seconds since it began): where a restart spends its time
            phases = json.loads((runs / job / "summary.json").read_text())["timings"]
            print(f"  {scenario}, the relaunch's phases: {phases}", flush=True)
            return took, took
        if scenario == "rank death":
            os.kill(pids[1], signal.SIGKILL)
        elif scenario == "hang":
            os.kill(pids[1], signal.SIGSTOP)
        else:
            from ray.util.state import list_actors

            node_id = next(a.node_id for a in list_actors(filters=[("pid", "=", pids[1])]))
            cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node_id))
        gone = None
        while gone is None or p.poll() is None:
            groups = [g for g in ray.util.placement_group_table().values()
                      if g["name"].startswith(job) and g["state"] != "REMOVED"]  # fmt: skip
            if gone is None and not groups and not any(_alive(pid) for pid in pids):
                gone = time.monotonic() - t0
            if time.monotonic() - t0 > 120:
                raise RuntimeError(f"{scenario}: not torn down within 120 s")
            time.sleep(0.01)
        exited = time.monotonic() - t0
        return gone - hang, exited - hang
    finally:
        if p.poll() is None:
            p.kill()
        if scenario == "node loss":
            cluster.add_node(num_cpus=2)
            cluster.wait_for_nodes()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hang-timeout", type=float, default=3.0)
    parser.add_argument(
        "--trainer",
        choices=("megatron", "loop"),
        default="megatron",
        help="what the restart scenarios run: the Megatron dry-run trainer, or a gloo loop (faster)",
    )
    args = parser.parse_args(argv)
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "dashboard_port": free_port(), "_system_config": HEALTH},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    results: dict[str, list[tuple[float, float]]] = {}
    try:
        for scenario in ("rank death", "node loss", "hang", *RESTARTS):
            job = f"fail-{scenario.replace(' ', '-')}"
            results[scenario] = [
                once(cluster, scenario, f"{job}{i}", args.hang_timeout, args.trainer)
                for i in range(args.repeats)
            ]
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"failure to teardown, 2 nodes x 1 rank (seconds, n={args.repeats}):", flush=True)
    notes = {
        "rank death": "",
        "node loss": f" (Ray health checks: {HEALTH['health_check_period_ms']} ms x "
        f"{HEALTH['health_check_failure_threshold']})",
        "hang": f" (after --hang-timeout {args.hang_timeout:g}s)",
    }
    to = (
        "first step after resuming"
        if args.trainer == "megatron"
        else "relaunched ranks past init_process_group"
    )
    for scenario, runs in results.items():
        if scenario in RESTARTS:
            how = "warm spares" if scenario == "restart" else "cold, --no-spares"
            print(f"  restart ({how}; SIGKILL to the {to}): {summary([r[0] for r in runs])}", flush=True)
            continue
        print(f"  {scenario}{notes[scenario]}: ranks gone + groups removed {summary([r[0] for r in runs])}; "
              f"driver exited {summary([r[1] for r in runs])}", flush=True)  # fmt: skip
    cold, warm = (statistics.median(r[0] for r in results[s]) for s in ("restart cold", "restart"))
    print(f"  restart cold/warm spares: {cold / warm:.1f}x", flush=True)
    print("  torchrun: a lost node or a hung rank waits for NCCL's watchdog (600 s by default)", flush=True)
    return results


if __name__ == "__main__":
    main()
