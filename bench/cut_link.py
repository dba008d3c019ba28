"""A cut link on real (namespace) machines, with Ray's default health checks: seconds from the cut to
the job's end (exit 1, the node named), and with `--max-restarts 1` to the relaunch and to its first
step on the machines left. Three machines from ../shared/netns/ray-cluster.sh (needs root), brought
up anew for each round; a gloo all-reduce every 0.2 s on 2 of them.

    python bench/cut_link.py --repeats 2        (also: python bench/failures.py --only cut)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, REPO, summary

SCRIPT = REPO.parent / "shared" / "netns" / "ray-cluster.sh"
WORKERS = {"10.77.0.9": "1", "10.77.0.11": "2"}  # the script's machine number of each worker IP
LOOP = """
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
for step in range(int(sys.argv[1])):
    t = torch.ones(1)
    dist.all_reduce(t)
    print("step", step, flush=True)
    time.sleep(0.2)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = os.path.dirname(PY) + os.pathsep + env.get("PATH", "")  # this venv's `ray`
    env["RAY_AUTH_MODE"] = "token"
    env["PYTHONUNBUFFERED"] = "1"
    return env


# Ray's health checks as docs/guides/failures.md shows tuning them (the head's GCS reads RAY_<setting>)
TUNED = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
         "RAY_health_check_failure_threshold": "3"}  # fmt: skip


def netns(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    p = subprocess.run(
        ["bash", str(SCRIPT), *args], env={**_env(), **(env or {})}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    if p.returncode != 0:
        raise RuntimeError(f"ray-cluster.sh {' '.join(args)}: {(p.stderr or p.stdout)[-500:]}")
    return p.stdout


class Launch:
    """A launch whose output lines are kept with the time each arrived."""

    def __init__(self, address: str, runs: Path, job: str, steps: int, extra: list[str], nodes: int = 2):
        script = runs / "loop.py"
        script.write_text(LOOP)
        cmd = [PY, str(REPO / "main.py"), "--address", address, "--device", "cpu", "--nodes", str(nodes),
               "--job-name", job, "--runs-dir", str(runs), *extra, str(script), str(steps)]  # fmt: skip
        self.runs, self.job = runs, job
        self.lines: list[tuple[float, str]] = []
        self.ended = 0.0
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: str, after: float) -> float | None:
        return next((t for t, line in list(self.lines) if t >= after and re.search(pattern, line)), None)

    def cut_a_worker(self, timeout_s: float = 120) -> tuple[str, float]:
        """Once rank 0 made 5 steps: the link of a worker the job runs on goes down."""
        deadline = time.monotonic() + timeout_s
        while self.first(r"\] step 5$", 0) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("\n".join(line for _, line in self.lines[-30:]))
            time.sleep(0.05)
        ranks = json.loads((self.runs / self.job / "topology.json").read_text())["ranks"]
        worker = next(r["node_ip"] for r in ranks if r["node_ip"] in WORKERS)
        netns("cut", WORKERS[worker], timeout=60)
        return worker, time.monotonic()

    def wait(self, timeout_s: float = 300) -> int:
        code = self.proc.wait(timeout_s)
        self.ended = time.monotonic()
        self.reader.join(10)
        return code


def one_round(work: Path, i: int, tuned: bool = False, everywhere: bool = False) -> dict[str, float | None]:
    """`everywhere`: a rank on each of the 3 machines, every rank's output on the console (the lost
    node's ranks among them), instead of 2 machines with rank 0's."""
    address = re.search(r"RAY_ADDRESS=(\S+)", netns("up", "3", env=TUNED if tuned else None)).group(1)
    layout = {"nodes": 3} if everywhere else {}
    shown = ["--log-ranks", "all"] if everywhere else []
    try:
        restarted = stepped = cut = None  # a relaunch on all 3 machines would wait for the lost one
        if not everywhere:
            survive = Launch(address, work, f"survive{i}", 60, ["--max-restarts", "1"])
            _, cut = survive.cut_a_worker()
            relaunched = survive.wait() == 0
            restarted = survive.first(r"restart 1 of 1 after: .*was lost", cut) if relaunched else None
            stepped = survive.first(r"\] step 0$", restarted) if restarted else None
        fail = Launch(address, work, f"fail{i}", 100000, shown, **layout)
        _, cut2 = fail.cut_a_worker()
        code = fail.wait()
        named = fail.first(r"was lost", cut2)
        for t, line in fail.lines if os.environ.get("CUT_LINK_SHOW") else ():
            if t >= cut2 - 0.5 and "] step " not in line:
                print(f"{t - cut2:7.2f} {line[:160]}", flush=True)
        return {
            "to relaunch": restarted - cut if restarted else None,
            "to first step after relaunch": stepped - cut if stepped else None,
            "to exit": fail.ended - cut2 if code == 1 and named else None,
        }
    finally:
        netns("down", timeout=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--tuned", action="store_true", help="Ray's health checks at 500 ms x 3, not defaults"
    )
    parser.add_argument(
        "--everywhere", action="store_true",
        help="a rank on each of the 3 machines, every rank's output on the console (--log-ranks all)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or not SCRIPT.exists():
        raise SystemExit(f"bench/cut_link.py needs root and {SCRIPT}")
    work = Path(tempfile.mkdtemp(prefix="megaray-cut-"))
    rounds = [one_round(work, i, args.tuned, args.everywhere) for i in range(args.repeats)]
    checks = "tuned (500 ms x 3)" if args.tuned else "default"
    print(f"a cut link, Ray's {checks} health checks (seconds from the cut, n={args.repeats}):")
    layout = "3 machines x 1 rank, every rank on the console" if args.everywhere else "2 machines x 1 rank"
    print(f"  ({layout})")
    keys = ("to exit",) if args.everywhere else ("to exit", "to relaunch", "to first step after relaunch")
    for key in keys:
        values = [r[key] for r in rounds if r[key] is not None]
        missing = len(rounds) - len(values)
        print(f"  {key}: {summary(values)}" + (f"; not reached {missing} times" if missing else ""))
    return {"rounds": rounds}


if __name__ == "__main__":
    main()
