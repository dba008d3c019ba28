"""Failure detection and teardown: a killed rank, a lost node, a hung (SIGSTOPped) rank.

For each, the time from the event to every rank process gone with the job's placement groups
removed, and to the driver's exit, on a simulated cluster (2 nodes x 1 CPU rank). Node loss is
detected by Ray's health checks, set here as docs/guides/failures.md shows (period 500 ms, 3
misses); a hang by --hang-timeout, which is subtracted so what is left is megaray's own delay (stack
reading included). torchrun has no counterpart for those two: a lost node or a hung rank waits for
NCCL's watchdog (10 minutes by default). Last, restart speed: with --max-restarts 1, from a rank's
SIGKILL to the first training step after the relaunch, on warm spares (the default) and cold
(--no-spares), with the Megatron dry-run trainer (megatron-core GPT, checkpoint every step) or, with
--trainer loop, to every relaunched rank past init_process_group.

    python bench/failures.py --repeats 3 --hang-timeout 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from common import PY, REPO, clean_env, median, quiet_port, simulated_cluster, stop_cluster, summary

HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
# Ranks that train as a job would: a collective and a line of output every 0.1 s, so one stopped
# rank leaves its peer blocked in the all-reduce and the whole job silent.
LOOP = """
import os, sys, time
import torch, torch.distributed as dist
from launcher import report
dist.init_process_group("gloo")
open(os.path.join(sys.argv[1], f"pid-{dist.get_rank()}"), "w").write(str(os.getpid()))
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 0):  # --children: as DataLoader workers
    if os.fork() == 0:  # they hold the rank's sockets, and look for their parent every 5 s as torch's do
        parent = os.getppid()
        while os.getppid() == parent:
            time.sleep(5.0)
        os._exit(0)
step = 0
while True:
    t = torch.ones(1)
    dist.all_reduce(t)
    print("step", flush=True)
    step += 1
    report(step)
    time.sleep(0.1)
"""
# The dry-run trainer as a plain script, for torchrun: only the training, whose one
# init_process_group suits torchrun's agent store (its keys outlive a process group; a second init in
# the same attempt can read the first one's stale addresses).
DRY_RUN = """
import os, sys
open(os.path.join(sys.argv[1], f"pid-{os.environ['RANK']}"), "w").write(str(os.getpid()))
from launcher.core.target import parse_dry_run_options as parse_options
from launcher.megatron.tiny_gpt import train
train(**parse_options(sys.argv[2:]))
"""
RESTART_MODES = ("warm spares", "cold", "torchrun")
# The relaunched trainer's first step: the dry run resumes, then saves after its first step.
FIRST_STEP = re.compile(r"resumed from checkpoint at iteration \d+\n[\s\S]*saved checkpoint")


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


def once(cluster, scenario: str, job: str, hang_timeout: float, children: int = 0) -> tuple[float, float]:
    """A killed rank, a lost node or a hang: (seconds to ranks gone and groups removed, to exit).
    `children`: processes each rank forks (--children)."""
    import ray

    from launcher.driver.cluster.cluster import SIMULATED_NODE

    runs = Path(tempfile.mkdtemp(prefix="megaray-failures-"))
    (runs / "loop.py").write_text(LOOP)
    hang = hang_timeout if scenario == "hang" else 0
    cmd = [PY, str(REPO / "main.py"), "--address", cluster.address, "--job-name", job, "--device", "cpu",
           "--nodes", "2", "--gpus-per-node", "1", "--runs-dir", str(runs), "--hang-timeout", str(hang),
           str(runs / "loop.py"), str(runs), str(children)]  # fmt: skip
    p = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        topo, log0 = runs / job / "topology.json", runs / job / "rank-0.log"
        _wait(scenario, lambda: topo.exists() and len(list(runs.glob("pid-*"))) == 2, p, 120)
        if scenario == "hang":  # stop a rank only once the job has printed: the hang clock is running
            _wait(scenario, lambda: "step" in _text(log0), p, 120)
            time.sleep(0.5)
        pids = [r["pid"] for r in json.loads(topo.read_text())["ranks"]]
        t0 = time.monotonic()
        if scenario == "rank death":
            os.kill(pids[1], signal.SIGKILL)
        elif scenario == "hang":
            os.kill(pids[1], signal.SIGSTOP)
        else:
            from ray.util.state import list_actors

            node_id = next(
                a.node_id for a in list_actors(address=cluster.address, filters=[("pid", "=", pids[1])])
            )
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
            cluster.add_node(num_cpus=2, **SIMULATED_NODE)
            cluster.wait_for_nodes()


def restart_once(cluster, mode: str, job: str, trainer: str, children: int = 0) -> float | None:
    """--max-restarts 1 and a SIGKILL of rank 1: seconds to the relaunch's first step (the dry-run
    trainer resumes from its checkpoint, trains a step and saves it) or, for the loop, to the
    relaunched rank 0 past init_process_group; None if the relaunch failed. `mode`: megaray on warm
    spares, megaray cold, or torchrun (`--standalone --max-restarts 1`, 2 processes)."""
    runs = Path(tempfile.mkdtemp(prefix="megaray-restart-"))
    (runs / "loop.py").write_text(LOOP)
    (runs / "dry.py").write_text(DRY_RUN)
    train_args = ["steps=1000000", f"save={runs / 'ckpt'}", "save_every=1"]
    if mode == "torchrun":
        script = (
            ["dry.py", str(runs), *train_args]
            if trainer == "megatron"
            else ["loop.py", str(runs), str(children)]
        )
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", str(runs / script[0]), *script[1:]]  # fmt: skip
        log0 = runs / "driver.out"  # torchrun passes rank 0's output through
    else:
        cmd = [PY, str(REPO / "main.py"), "--address", cluster.address, "--job-name", job, "--device", "cpu",
               "--nodes", "2", "--gpus-per-node", "1", "--runs-dir", str(runs), "--max-restarts", "1",
               "--spares" if mode == "warm spares" else "--no-spares"]  # fmt: skip
        cmd += (
            ["--dry-run", *train_args]
            if trainer == "megatron"
            else [str(runs / "loop.py"), str(runs), str(children)]
        )
        log0 = runs / job / "rank-0.log"
    topo, driver_out = runs / job / "topology.json", runs / "driver.out"

    def victim() -> int | None:  # rank 1: megaray's topology has it; torchrun's ranks write theirs
        if mode != "torchrun":
            return json.loads(topo.read_text())["ranks"][1]["pid"] if topo.exists() else None
        return int(_text(runs / "pid-1") or 0) or None

    def training() -> bool:
        if trainer == "loop":
            return victim() is not None and _text(runs / "pid-0") != ""
        return victim() is not None and "saved checkpoint at iteration 2" in _text(log0)

    env = clean_env()
    if mode == "torchrun":
        # torchrun's relaunched ranks otherwise read the previous attempt's addresses from the
        # rendezvous store it shares with them, and fail to connect (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with driver_out.open("w") as sink:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        _wait(mode, training, p)
        if mode == "warm spares":  # kill a rank once the spares are ready, as in a long run
            _wait(mode, lambda: "warm spare(s) ready" in _text(driver_out), p)
        first = _text(runs / "pid-0")
        t0 = time.monotonic()
        os.kill(victim(), signal.SIGKILL)
        try:
            if trainer == "megatron":
                _wait(mode, lambda: FIRST_STEP.search(_text(log0)) is not None, p)
            else:
                _wait(mode, lambda: _text(runs / "pid-0") not in ("", first), p, 120)
        except RuntimeError:
            last = [line for line in _text(driver_out).splitlines() if "Error" in line][-1:]
            print(f"  restart ({mode}): the relaunch failed: {' '.join(last)[:300]}", flush=True)
            return None
        took = time.monotonic() - t0
        p.send_signal(signal.SIGINT)
        p.wait(60)
        if mode != "torchrun":  # where the relaunch spent its time (seconds since it began)
            phases = json.loads((runs / job / "summary.json").read_text())["timings"]
            print(f"  restart ({mode}), the relaunch's phases: {phases}", flush=True)
        return took
    finally:
        if p.poll() is None:
            p.kill()


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
    parser.add_argument(
        "--only",
        choices=("teardown", "restart", "cut"),
        help="run only these scenarios (cut: bench/cut_link.py)",
    )
    parser.add_argument(
        "--children",
        type=int,
        default=0,
        help="with the gloo loop: processes each rank forks, holding its sockets as DataLoader workers do",
    )
    parser.add_argument(
        "--restart-modes",
        default=",".join(RESTART_MODES),
        help=f"of the restart scenarios: a comma-separated subset of {','.join(RESTART_MODES)}",
    )
    args = parser.parse_args(argv)
    asked = args.restart_modes.split(",")
    if unknown := sorted(set(asked) - set(RESTART_MODES)):
        parser.error(f"--restart-modes: unknown {', '.join(unknown)}; choose from {','.join(RESTART_MODES)}")
    args.restart_modes = [m for m in RESTART_MODES if m in asked]
    if args.only == "cut":  # real (namespace) machines, not the simulated cluster below
        import cut_link

        return cut_link.main(["--repeats", str(args.repeats)])
    import ray

    from launcher.driver.cluster.cluster import SIMULATED_NODE

    head = {"num_cpus": 0, "dashboard_port": quiet_port(), "_system_config": HEALTH}
    cluster = simulated_cluster(head, [{"num_cpus": 2, **SIMULATED_NODE}] * 2)
    ray.init(address=cluster.address, log_to_driver=False)
    results: dict[str, list[tuple[float, float]]] = {}
    restarts: dict[str, list[float]] = {}
    try:
        for scenario in ("rank death", "node loss", "hang") if args.only != "restart" else ():
            results[scenario] = [
                once(cluster, scenario, f"fail-{scenario.split()[0]}{i}", args.hang_timeout, args.children)
                for i in range(args.repeats)
            ]
        # interleaved, so that load on the machine hits all three alike
        for i in range(args.repeats if args.only != "teardown" else 0):
            for mode in args.restart_modes:
                job = f"restart-{mode.split()[0]}{i}"
                restarts.setdefault(mode, []).append(
                    restart_once(cluster, mode, job, args.trainer, args.children)
                )
    finally:
        ray.shutdown()
        stop_cluster(cluster)
    print(f"failure to teardown, 2 nodes x 1 rank (seconds, n={args.repeats}):", flush=True)
    notes = {
        "rank death": "",
        "node loss": f" (Ray health checks: {HEALTH['health_check_period_ms']} ms x "
        f"{HEALTH['health_check_failure_threshold']})",
        "hang": f" (after --hang-timeout {args.hang_timeout:g}s)",
    }
    for scenario, runs in results.items():
        print(f"  {scenario}{notes[scenario]}: ranks gone + groups removed {summary([r[0] for r in runs])}; "
              f"driver exited {summary([r[1] for r in runs])}", flush=True)  # fmt: skip
    print("  torchrun: a lost node or a hung rank waits for NCCL's watchdog (600 s by default)", flush=True)
    if not restarts:
        return results
    to = (
        "first step after resuming"
        if args.trainer == "megatron"
        else "relaunched rank 0 past init_process_group"
    )
    print(f"restart, --max-restarts 1, 2 ranks, SIGKILL of rank 1 to the {to} (seconds):", flush=True)
    done = {mode: [t for t in times if t is not None] for mode, times in restarts.items()}
    for mode, times in restarts.items():
        lost = len(times) - len(done[mode])
        failed = f"; the relaunch failed {lost} of {len(times)} times" if lost else ""
        name = mode if mode == "torchrun" else f"megaray {mode}"
        print(f"  {name}: {summary(done[mode])}{failed}", flush=True)
    if all(done.values()) and "torchrun" in done and len(done) > 1:
        base = median(done["torchrun"])
        ratios = ", ".join(f"{mode} {median(done[mode]) / base:.2f}" for mode in done if mode != "torchrun")
        print(f"  megaray/torchrun: {ratios}", flush=True)
    return {**results, **{f"restart {mode}": times for mode, times in restarts.items()}}


if __name__ == "__main__":
    main()
