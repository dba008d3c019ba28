"""The goodput ledger (core/goodput.py, #47) against what a run was made to spend: two restarts (a
rank that fails, then a lost node), a straggler and checkpoints, on a simulated cluster of 3 nodes x
1 CPU rank slot (a job of 2 ranks, one node spare).

A plain program of 2 ranks (gloo, an all-reduce a step), rank 0 reporting every iteration
(`launcher.report`): it waits `--startup-s` before its first iteration, then each step sleeps
`--pace-s`; every `--save-every` iterations every rank sleeps `--save-s` (rank 0 says it with
`launcher.checkpointing`), and a relaunch waits `--relaunch-s`, then loads for `--load-s` (said
the same way) and resumes from the last save. Attempt 0's rank 0 exits 1 at `--fail-at`; in attempt
1 the bench removes rank 1's node once rank 0 printed `--lose-at`; in attempt 2 rank 1 steps 4x
slower from `--slow-from` for `--slow-for` iterations.

What each cause truly cost is worked out from rank 0's own timestamps (it prints one with each
iteration): an iteration's time less a save made in it; the straggler's, what its iterations took
beyond the balanced median; recomputed, the iterations made again at that median (the first of an
attempt included, as the ledger counts it); the saves and loads as slept. The start-up and the
restarts hold what the program waited on purpose plus megaray's own part (the processes' start,
finding the failure or the lost node, the teardown, the relaunch), shown apart.

    python bench/goodput.py

The last line is machine-readable.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, REPO, clean_env, quiet_port, simulated_cluster, stop_cluster

PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    import launcher

    pace, startup, relaunch, save_s, load_s = map(float, sys.argv[1:6])
    every, total, fail_at, slow_from, slow_for = map(int, sys.argv[6:11])
    saved = os.path.join(sys.argv[11], "iteration")
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    time.sleep(relaunch if attempt else startup)
    start = int(open(saved).read()) if os.path.exists(saved) else 0
    if start:
        with launcher.checkpointing(start, loading=True):
            time.sleep(load_s)
    t = torch.zeros(1)
    for it in range(start + 1, total + 1):
        slow = rank == 1 and attempt == 2 and slow_from <= it < slow_from + slow_for
        time.sleep(pace * (4 if slow else 1))
        dist.all_reduce(t)
        if rank == 0:
            print(f"attempt {attempt} at {it} {time.time():.4f}", flush=True)
            launcher.report(it, total=total)
        if it % every == 0:  # every rank saves its part
            with launcher.checkpointing(it):
                time.sleep(save_s)
                if rank == 0:
                    with open(saved + ".tmp", "w") as f:
                        f.write(str(it))
                    os.replace(saved + ".tmp", saved)
        if attempt == 0 and it == fail_at and rank == 0:
            sys.exit(1)
    dist.destroy_process_group()
    """
)
LINE = re.compile(r"attempt (\d+) at (\d+) ([\d.]+)")


def truth(a: argparse.Namespace, log: str) -> dict[str, float]:
    """What each cause cost, from rank 0's timestamps (module docstring)."""
    seen: dict[int, list[tuple[int, float]]] = {}
    for m in LINE.finditer(log):
        seen.setdefault(int(m.group(1)), []).append((int(m.group(2)), float(m.group(3))))
    steps = {}  # (attempt, iteration) -> its time, less a save made in it
    for k, its in seen.items():
        for (n0, t0), (n1, t1) in itertools.pairwise(its):
            steps[(k, n1)] = t1 - t0 - (a.save_s if n0 % a.save_every == 0 else 0.0)
    slow = set(range(a.slow_from, a.slow_from + a.slow_for))
    base = statistics.median(s for (k, n), s in steps.items() if not (k == 2 and n in slow))
    straggler = sum(s - base for (k, n), s in steps.items() if k == 2 and n in slow)
    recomputed, reached = 0.0, 0
    for k in sorted(seen):
        first = seen[k][0][0]
        if k:
            recomputed += max(0, reached - first + 1) * base
        reached = max(reached, seen[k][-1][0])
    made = sum(len(its) for its in seen.values())
    saves = sum(1 for its in seen.values() for n, _ in its if n % a.save_every == 0)
    return {
        "training": sum(steps.values()) - straggler - (recomputed - (len(seen) - 1) * base),
        "recomputed": recomputed,
        "checkpoint": saves * a.save_s + (len(seen) - 1) * a.load_s,
        "straggler": straggler,
        "start-up": a.startup_s,  # + megaray's part (and the first iteration)
        "restarts": (len(seen) - 1) * a.relaunch_s,  # + megaray's part
        "iterations": made,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pace-s", type=float, default=0.1)
    ap.add_argument("--startup-s", type=float, default=10.0)
    ap.add_argument("--relaunch-s", type=float, default=10.0)
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--save-s", type=float, default=1.5)
    ap.add_argument("--load-s", type=float, default=2.0)
    ap.add_argument("--fail-at", type=int, default=90)
    ap.add_argument("--lose-at", type=int, default=160)
    ap.add_argument("--slow-from", type=int, default=300)
    ap.add_argument("--slow-for", type=int, default=200)
    ap.add_argument("--iterations", type=int, default=600)
    a = ap.parse_args()
    from ray.util.state import list_actors

    from launcher.driver.cluster.cluster import SIMULATED_NODE

    work = Path(tempfile.mkdtemp(prefix="megaray-goodput-"))
    (work / "ckpt").mkdir()
    program = work / "program.py"
    program.write_text(PROGRAM)
    port = quiet_port()  # the dashboard's, asked below for the lost rank's node
    head = {"num_cpus": 0, "dashboard_port": port}
    cluster = simulated_cluster(head, [{"num_cpus": 1, **SIMULATED_NODE}] * 3)
    nodes = list(cluster.worker_nodes)
    try:
        args = (a.pace_s, a.startup_s, a.relaunch_s, a.save_s, a.load_s, a.save_every, a.iterations,
                a.fail_at, a.slow_from, a.slow_for, work / "ckpt")  # fmt: skip
        cmd = [PY, "main.py", "--address", cluster.address, "--device", "cpu", "--nodes", "2",
               "--gpus-per-node", "1", "--max-restarts", "2", "--no-spares", "--job-name", "goodput",
               "--runs-dir", str(work), str(program), *map(str, args)]  # fmt: skip
        out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "bufsize": 1}
        proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), **out)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if f"attempt 1 at {a.lose_at} " in line:  # rank 1's node goes
                pid = json.loads((work / "goodput" / "topology.json").read_text())["ranks"][1]["pid"]
                node_id = list_actors(address=f"http://127.0.0.1:{port}", filters=[("pid", "=", pid)])[
                    0
                ].node_id
                cluster.remove_node(next(n for n in nodes if n.node_id == node_id))
                lines.append(f"(the bench removed rank 1's node at {time.time():.4f})\n")
        proc.wait()
    finally:
        stop_cluster(cluster)
    said = "".join(lines)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{said[-3000:]}")
    summary = json.loads((work / "goodput" / "summary.json").read_text())
    seconds = summary["goodput"]["seconds"]
    made = truth(a, (work / "goodput" / "rank-0.log").read_text())
    print(f"restarts: {[r['cause'][:70] for r in summary['restarts']]}")
    print(f"{'cause':<11} {'ledger s':>9} {'made s':>8} {'off':>8}")
    off = {}
    for cause, s in seconds.items():
        want = made.get(cause)
        if want is None:
            print(f"{cause:<11} {s:>9.2f}")
            continue
        megaray = cause in ("start-up", "restarts")
        off[cause] = (s - want) if megaray else (s - want) / want if want else float("nan")
        shown = f"{off[cause]:>+7.2f}s (megaray's)" if megaray else f"{100 * off[cause]:>+7.1f}%"
        print(f"{cause:<11} {s:>9.2f} {want:>8.2f} {shown}")
    total, wall = sum(seconds.values()), summary["duration_s"]
    print(f"parts add up to {total:.2f} s of duration_s {wall:.2f} s ({100 * abs(total - wall) / wall:.2f}%)")
    print(
        f"wall_s={wall:.2f} sum_off={abs(total - wall) / wall:.4f} "
        + " ".join(f"{c}_off={v:.4f}" for c, v in off.items() if c not in ("start-up", "restarts"))
        + f" startup_megaray_s={off['start-up']:.2f} restarts_megaray_s={off['restarts']:.2f}"
    )


if __name__ == "__main__":
    main()
