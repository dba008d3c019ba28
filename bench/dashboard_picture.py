"""The docs' picture of the Grafana dashboard (docs/img/dashboard.png), made from a real run as a user
would make it: a two-node `ray start` cluster with its dashboard (tests/raycluster.py: token
authentication, as Ray 2.60 has it; 2 CPUs a node), a Prometheus (Debian's package) reading the
targets Ray's dashboard lists, the Megatron dry run on 2 x 2 CPU ranks (DP 4) with
`--max-restarts 1`, one rank slowed 4x from outside for a while (a straggler) and later killed (a
relaunch, resumed from its checkpoint), then examples/grafana/snapshot.py over the run. No Grafana
is used: its licence keeps it off these machines; the snapshot draws the dashboard's own panels and
queries.

    python bench/dashboard_picture.py --out docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, REPO, throttle

JOB = "llm-dry-run"


def wait_for(what: str, ready, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.5)


def rank_pid(runs: Path, rank: int) -> int:
    topology = json.loads((runs / JOB / "topology.json").read_text())
    return next(r["pid"] for r in topology["ranks"] if r["rank"] == rank)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "dashboard.png")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--slow-at", type=float, default=60, help="seconds into the run: rank 3 slowed 4x")
    ap.add_argument("--slow-s", type=float, default=40)
    ap.add_argument("--kill-at", type=float, default=150, help="seconds into the run: rank 1 killed")
    args = ap.parse_args()
    if shutil.which("prometheus") is None:
        sys.exit("needs Debian's prometheus package: apt-get install prometheus")
    sys.path.insert(0, str(REPO))
    from tests.prometheus import Prometheus
    from tests.raycluster import start_cluster

    work = Path(tempfile.mkdtemp(prefix="megaray-dashboard-"))
    cluster = start_cluster(num_cpus=2, RAY_metrics_report_interval_ms="2000")
    prom = driver = None
    try:
        cluster.add_worker(num_cpus=2)
        env = {k: v for k, v in cluster.env.items() if k != "RAY_AUTH_MODE"}  # as a user's shell has it
        env["PYTHONPATH"] = str(REPO)
        sd = cluster.tmp / "session_latest" / "prom_metrics_service_discovery.json"
        prom = Prometheus(sd, work, scrape_s=2.0)
        runs = work / "runs"
        start = time.time()
        driver = subprocess.Popen(
            [PY, str(REPO / "main.py"), "--address", cluster.gcs, "--device", "cpu", "--nodes", "2",
             "--gpus-per-node", "2", "--job-name", JOB, "--runs-dir", str(runs), "--max-restarts", "1",
             "--hang-timeout", "0", "--dry-run", f"steps={args.steps}", f"save={work / 'ckpt'}",
             "save_every=200", "tp=1"],
            env=env, cwd=work, stdout=(work / "driver.log").open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_for("the topology", lambda: (runs / JOB / "topology.json").exists())
        time.sleep(max(0.0, start + args.slow_at - time.time()))
        done = threading.Event()
        threading.Thread(target=throttle, args=(rank_pid(runs, 3), done), daemon=True).start()
        time.sleep(args.slow_s)
        done.set()
        time.sleep(max(0.0, start + args.kill_at - time.time()))
        os.kill(rank_pid(runs, 1), signal.SIGKILL)
        rc = driver.wait(1800)
        print(f"the run ended with {rc} after {time.time() - start:.0f} s", flush=True)
        time.sleep(6)  # the last export and scrape
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # the dashboard as it stood 10 s before the end, while training (after it, the states that
        # the driver set last may not have been exported before it exited)
        end = json.loads((runs / JOB / "summary.json").read_text())["ended_at"] - 10
        minutes = f"{(end - start) / 60 + 0.5:.1f}"
        snapshot = str(REPO / "examples" / "grafana" / "snapshot.py")
        shot = [PY, snapshot, "--prometheus", prom.url, "--job", JOB, "--end", str(end), "--minutes", minutes,
                "--out", str(args.out)]  # fmt: skip
        subprocess.run(shot, check=True)
        print((work / "driver.log").read_text()[-1500:])
    finally:
        if driver is not None and driver.poll() is None:
            driver.send_signal(signal.SIGINT)
            driver.wait(60)
        if prom is not None:
            prom.stop()
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
