"""Failure teardown against torchrun: SIGKILL one rank, then time until every rank process is gone
and (megaray) every actor and placement group of the job is removed and the driver has exited.

Both launchers send the surviving ranks SIGTERM first. Ranks without a handler of their own end on
it at once; with `--handler-s S` a second round runs ranks whose SIGTERM handler takes S seconds
(a checkpoint on SIGTERM), which both launchers must wait for.

    python bench/teardown.py --ranks 4 --repeats 3 --handler-s 0.5

`--driver-signal`: also SIGTERM to the launcher itself, attached to the running Ray, to its exit;
with `--own-ray` also megaray starting its own Ray (which it stops before it exits).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from common import PY, REPO, clean_env, median, ray_cluster, summary

TARGET = str(REPO / "bench" / "targets.py")
SIGNALED = "SIGTERM to the launcher: "
OWN_RAY = "megaray starting its own Ray"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def once(
    cmd: list[str], ranks: int, job_groups=None, handler_s: float | None = None, driver_signal: bool = False
) -> tuple[float, float]:
    """(seconds from the kill to the last rank process gone, seconds to the driver's exit). With
    `driver_signal`, the launcher itself gets SIGTERM (a scheduler's preemption, `kill`), not a rank
    SIGKILL."""
    out = Path(tempfile.mkdtemp(prefix="megaray-teardown-"))
    env = {**clean_env(), "BENCH_OUT": str(out)}
    extra = [] if handler_s is None else [str(handler_s)]
    p = subprocess.Popen([*cmd, TARGET, str(out), *extra], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while len(list(out.glob("pid-*"))) < ranks:
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(cmd)} ended before its ranks started")
            time.sleep(0.02)
        time.sleep(0.2)
        pids = [int(f.read_text()) for f in sorted(out.glob("pid-*"))]
        t0 = time.monotonic()
        if driver_signal:
            p.send_signal(signal.SIGTERM)
        else:
            os.kill(pids[1], signal.SIGKILL)
        gone = None
        while gone is None or p.poll() is None:
            if (
                gone is None
                and not any(_alive(pid) for pid in pids)
                and (job_groups is None or not job_groups())
            ):
                gone = time.monotonic() - t0
            if time.monotonic() - t0 > 60:
                raise RuntimeError("teardown took over 60 s")
            time.sleep(0.005)
        return gone, time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
        shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--handler-s", type=float, help="also time ranks whose SIGTERM handler takes this long"
    )
    parser.add_argument(
        "--driver-signal", action="store_true",
        help="also time SIGTERM to the launcher itself, ranks ending at once on it: to its exit",
    )  # fmt: skip
    parser.add_argument(
        "--own-ray", action="store_true",
        help="with --driver-signal, also megaray starting its own Ray (and stopping it before it exits)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    n = args.ranks
    handlers = [None] if args.handler_s is None else [None, args.handler_s]
    res: dict[str, list[tuple[float, float]]] = {}
    with ray_cluster(nodes=1, cpus_per_node=n) as address:
        import ray

        ray.init(address=address, log_to_driver=False)
        try:

            def groups(job):
                return lambda: [g for g in ray.util.placement_group_table().values()
                                if g["name"].startswith(job) and g["state"] != "REMOVED"]  # fmt: skip

            for h in handlers:
                suffix = "" if h is None else f" (SIGTERM handler {h:g}s)"
                for i in range(args.repeats):
                    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
                    res.setdefault("torchrun" + suffix, []).append(once(torchrun, n, handler_s=h))
                    job = f"teardown{'h' if h else ''}{i}"
                    cmd = [PY, str(REPO / "main.py"), "--address", address, "--job-name", job, "--device",
                           "cpu", "--gpus-per-node", str(n), "--cpus-per-rank", "0.5"]  # fmt: skip
                    res.setdefault("megaray" + suffix, []).append(once(cmd, n, groups(job), handler_s=h))
            for i in range(args.repeats if args.driver_signal else 0):
                torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
                res.setdefault(SIGNALED + "torchrun", []).append(once(torchrun, n, driver_signal=True))
                job = f"teardowns{i}"
                cmd = [PY, str(REPO / "main.py"), "--address", address, "--job-name", job, "--device",
                       "cpu", "--gpus-per-node", str(n), "--cpus-per-rank", "0.5"]  # fmt: skip
                res.setdefault(SIGNALED + "megaray", []).append(once(cmd, n, groups(job), driver_signal=True))
                if args.own_ray:  # its own Ray, stopped before it exits (#45: Ray's stop was most of it)
                    own = [PY, str(REPO / "main.py"), "--job-name", f"{job}own", "--device", "cpu",
                           "--gpus-per-node", str(n), "--cpus-per-rank", "0.5"]  # fmt: skip
                    res.setdefault(SIGNALED + OWN_RAY, []).append(once(own, n, driver_signal=True))
        finally:
            ray.shutdown()
    print(f"{n} ranks, SIGKILL of rank 1 (seconds, median of {args.repeats}):", flush=True)
    for name, runs in res.items():
        if name.startswith(SIGNALED):
            continue
        what = "ranks gone + groups removed" if name.startswith("megaray") else "ranks gone"
        gone, exited = summary([r[0] for r in runs]), summary([r[1] for r in runs])
        print(f"  {name:9s} {what}: {gone}; driver exited: {exited}")
    for h in handlers:
        suffix = "" if h is None else f" (SIGTERM handler {h:g}s)"
        ratio = median([r[0] for r in res["megaray" + suffix]]) / median(
            [r[0] for r in res["torchrun" + suffix]]
        )
        print(f"  megaray/torchrun (ranks gone){suffix}: {ratio:.2f}", flush=True)
    if args.driver_signal:
        mine, theirs = res[SIGNALED + "megaray"], res[SIGNALED + "torchrun"]
        print(f"{n} ranks, SIGTERM to the launcher (seconds, median of {args.repeats}):", flush=True)
        own = res.get(SIGNALED + OWN_RAY, [])
        rows = [("torchrun  ranks gone", theirs), ("megaray   ranks gone + groups removed", mine)]
        for name, runs in rows + ([("megaray, own Ray, ranks gone", own)] if own else []):
            print(f"  {name}: {summary([r[0] for r in runs])}; exited: {summary([r[1] for r in runs])}")
        ratio = median([r[1] for r in mine]) / median([r[1] for r in theirs])
        print(f"  megaray/torchrun (exited): {ratio:.2f}", flush=True)
        if own:
            ratio = median([r[1] for r in own]) / median([r[1] for r in theirs])
            print(f"  megaray starting its own Ray/torchrun (exited): {ratio:.2f}", flush=True)
    return res


if __name__ == "__main__":
    main()
