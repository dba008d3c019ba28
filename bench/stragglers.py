"""Straggler detection (rank/waits.py, core/straggler.py): what watching costs, and how soon a slow
rank is named, on a simulated cluster of 2 nodes x 2 CPU ranks.

- the looks alone: steps in one process with the sampler thread on and off, in turn.
- overhead: 2 ranks (one per node, no core shared) of a gloo program whose steps compute (a 1-thread
  matmul) then all-reduce, run with the
  ranks' looks on and off (`--env MEGARAY_STRAGGLERS=off`), alternately; rank 0 prints its median
  step time; the ratio of the medians is the cost of watching.
- naming: rank 3 computes 4x as long a step as the others; seconds from the topology line to the
  console naming rank 3, and the slowdown it states.
- the Megatron target's forward steps timed (megatron/steptimes.py), `--megatron`: a forward-step-
  like call (4 matmuls) timed and not, in turn, in one process; and the dry-run trainer on 2 nodes
  x 1 rank with the timing on and off, alternately: its seconds per iteration from the first
  progress report to the end (summary.json), and the ratio of the medians. Then naming: the
  dry-run trainer on 3 ranks (TP 1 x PP 1 x DP 3), rank 2 made 4x slower from outside (stopped 75%
  of the time) from its first progress report; seconds from there to the console naming rank 2.

    python bench/stragglers.py --repeats 3
    python bench/stragglers.py --false-positives 600     (a loaded balanced run: who is named)
    python bench/stragglers.py --megatron --repeats 5
    python bench/stragglers.py --megatron --false-positives 600   (the dry-run trainer, loaded)
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, REPO, clean_env, median, ray_cluster, summary, throttle

STEPS = """
import statistics, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
a = torch.randn(384, 384)
times = []
for i in range(int(sys.argv[1])):
    t = time.perf_counter()
    for _ in range(4):
        b = a @ a
    dist.all_reduce(b[:1, :1])
    times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(f"median step ms {1000 * statistics.median(times[10:]):.3f}", flush=True)
dist.destroy_process_group()
"""

SLOW_RANK = """
import sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
end = time.time() + float(sys.argv[1])
while True:
    time.sleep(0.2 if rank == 3 else 0.05)
    done = torch.tensor([1.0 if time.time() > end else 0.0])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    if done.item():
        break
"""

# Balanced: every rank computes 0.01-0.09 s at random each step, so each waits for whoever was last.
BALANCED = """
import random, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
end = time.time() + float(sys.argv[1])
while True:
    time.sleep(random.uniform(0.01, 0.09))
    done = torch.tensor([1.0 if time.time() > end else 0.0])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    if done.item():
        break
"""
BURN = (
    "import time\nend = time.time() + {s}\nwhile time.time() < end:\n    sum(i * i for i in range(10_000))\n"
)

NAMED = re.compile(r"rank 3 on .* is slow: about ([\d.]+)x")


def megaray(address: str, script: Path, args: list[str], extra: list[str] = (), per_node: int = 2):
    cmd = [PY, str(REPO / "main.py"), "--address", address, "--device", "cpu", "--nodes", "2",
           "--gpus-per-node", str(per_node), "--runs-dir", str(script.parent), *extra,
           str(script), *args]  # fmt: skip
    env = {**clean_env(), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


class Forwarder:
    """Takes the samples a rank sends its node's forwarder (`forwarder.sample.remote(s)`)."""

    sample = property(lambda self: self)

    def remote(self, *args) -> None:
        pass


def in_process(rounds: int = 8, steps: int = 300) -> tuple[list[float], list[float]]:
    """The looks alone: the same steps in this process with the sampler thread on and off, in turn
    (no Ray, no other process sharing the cores)."""
    import statistics
    import threading

    import torch

    from launcher.rank.waits import WaitSampler

    torch.set_num_threads(1)
    a = torch.randn(384, 384)

    def median_step_ms() -> float:
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            for _ in range(4):
                a @ a
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times)

    on, off = [], []
    for _ in range(rounds):
        off.append(median_step_ms())
        sampler = WaitSampler(Forwarder(), 0, threading.get_ident(), 2)
        on.append(median_step_ms())
        sampler.stop()
        sampler.thread.join()
    return on, off


def step_ms(address: str, script: Path, steps: int, watched: bool) -> float:
    extra = [] if watched else ["--env", "MEGARAY_STRAGGLERS=off"]
    out, _ = megaray(address, script, [str(steps)], extra, per_node=1).communicate(timeout=600)
    found = re.search(r"median step ms ([\d.]+)", out)
    if not found:
        raise RuntimeError(out[-3000:])
    return float(found.group(1))


def time_to_name(address: str, script: Path) -> tuple[float, float]:
    proc = megaray(address, script, ["40"])
    started = None
    for line in proc.stdout:
        if started is None and "megaray: topology" in line:
            started = time.monotonic()
        if found := NAMED.search(line):
            named, slowdown = time.monotonic() - started, float(found.group(1))
            proc.kill()
            proc.wait()
            return named, slowdown
    raise RuntimeError("rank 3 was never named")


def false_positives(address: str, work: Path, seconds: float) -> int:
    """Ranks named slow in a balanced run of `seconds`, with two processes burning the 2 cores."""
    script = work / "balanced.py"
    script.write_text(BALANCED)
    burners = [subprocess.Popen([PY, "-c", BURN.format(s=seconds + 30)]) for _ in range(2)]
    try:
        out, _ = megaray(address, script, [str(seconds)]).communicate(timeout=seconds + 300)
    finally:
        for b in burners:
            b.kill()
    return len(re.findall(r"is slow: about", out))


def timer_alone(rounds: int = 8, calls: int = 300) -> tuple[list[float], list[float]]:
    """The timing alone: a forward-step-like call (4 matmuls) through StepTimer and not, in turn."""
    import statistics

    import torch

    from launcher.megatron.steptimes import StepTimer

    torch.set_num_threads(1)
    a = torch.randn(384, 384)

    def step() -> None:
        for _ in range(4):
            a @ a

    def median_call_ms(call) -> float:
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times)

    timer = StepTimer(Forwarder(), 0, 2)
    on, off = [], []
    for _ in range(rounds):
        off.append(median_call_ms(step))
        on.append(median_call_ms(lambda: timer.call(step, (), {})))
    return on, off


RUN_NUMBER = itertools.count()


def dry_run(address: str, work: Path, job: str, layout: list[str], steps: int, extra: list[str] = ()):
    """The command of a dry run on CPU ranks, in `work`/`job`; `layout`: its --nodes etc."""
    return [PY, str(REPO / "main.py"), "--address", address, "--device", "cpu", *layout, "--runs-dir",
            str(work), "--job-name", job, *extra, "--dry-run", f"steps={steps}"]  # fmt: skip


THREE_RANKS = ["--nodes", "1", "--gpus-per-node", "3", "--cpus-per-rank", "0.5"]  # TP 1 x PP 1 x DP 3


def dry_run_iter_s(address: str, work: Path, steps: int, timed: bool) -> float:
    """Seconds per iteration of the dry-run trainer (TP 1 x PP 2 on 2 nodes x 1 CPU rank), from its
    first progress report to the ranks' end."""
    job = f"dry-{next(RUN_NUMBER)}"
    extra = [] if timed else ["--env", "MEGARAY_STRAGGLERS=off"]
    cmd = dry_run(address, work, job, ["--nodes", "2", "--gpus-per-node", "1"], steps, extra)
    done = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    s = json.loads((work / job / "summary.json").read_text())
    ended = s["started_at"] + s["timings"]["finished"]
    return (ended - s["progress"]["first_report_at"]) / (steps - 1)


def dry_run_time_to_name(address: str, work: Path) -> tuple[float, float]:
    job = f"dry-{next(RUN_NUMBER)}"
    cmd = dry_run(address, work, job, THREE_RANKS, 100_000)
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), **out)
    named, slowed, started = threading.Event(), None, None
    try:
        for line in proc.stdout:
            if started is None and "progress: iteration" in line:
                pid = json.loads((work / job / "topology.json").read_text())["ranks"][2]["pid"]
                slowed = threading.Thread(target=throttle, args=(pid, named), daemon=True)
                slowed.start()
                started = time.monotonic()
            if started is not None and (found := re.search(r"rank 2 on .* is slow: about ([\d.]+)x", line)):
                return time.monotonic() - started, float(found.group(1))
        raise RuntimeError("rank 2 was never named")
    finally:
        named.set()
        if slowed is not None:
            slowed.join()
        proc.terminate()
        proc.wait()


def dry_run_false_positives(address: str, work: Path, seconds: float) -> int:
    """Ranks named slow in `seconds` of a balanced dry-run trainer on 3 ranks (TP 1 x PP 1 x DP 3)
    with two processes burning the 2 cores: its forward steps are timed by the wall clock on a CPU,
    so the machine's load shows in them."""
    cmd = dry_run(address, work, f"dry-{next(RUN_NUMBER)}", THREE_RANKS, 10_000_000)
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    burners = [subprocess.Popen([PY, "-c", BURN.format(s=seconds + 120)]) for _ in range(2)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), **out)
    named, end = 0, None
    try:
        for line in proc.stdout:
            if end is None and "progress: iteration" in line:
                end = time.monotonic() + seconds
            named += " is slow: about" in line
            if end is not None and time.monotonic() > end:
                break
    finally:
        proc.terminate()
        proc.wait()
        for b in burners:
            b.kill()
    return named


def megatron_part(repeats: int, steps: int) -> dict:
    sys.path.insert(0, str(REPO))
    alone_on, alone_off = timer_alone()
    print(f"a forward-step-like call, ms: timed {summary(alone_on)}; not {summary(alone_off)}; "
          f"ratio {median(alone_on) / median(alone_off):.4f}")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="megaray-steptimes-"))
    on, off, names = [], [], []
    with ray_cluster(nodes=2, cpus_per_node=2, gpus_per_node=1) as address:
        for _ in range(repeats):
            off.append(1000 * dry_run_iter_s(address, work, steps, timed=False))
            on.append(1000 * dry_run_iter_s(address, work, steps, timed=True))
        ratio = median(on) / median(off)
        print(f"dry-run trainer, ms/iteration: timed {summary(on)}; not {summary(off)}; ratio {ratio:.4f}")
        for _ in range(repeats):
            names.append(dry_run_time_to_name(address, work))
    print(f"rank 2 of the dry-run trainer (4x slower) named after {summary([n for n, _ in names])} s; "
          f"stated slowdown {summary([s for _, s in names])}")  # fmt: skip
    return {"on": on, "off": off, "ratio": ratio, "alone": (alone_on, alone_off), "named": names}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument(
        "--false-positives", type=float, metavar="S", help="only: a loaded balanced run of S s"
    )
    parser.add_argument("--megatron", action="store_true", help="only: the Megatron target's step timing")
    args = parser.parse_args(argv)
    if args.megatron and args.false_positives:
        with ray_cluster(nodes=2, cpus_per_node=2, gpus_per_node=1) as address:
            named = dry_run_false_positives(address, Path(tempfile.mkdtemp()), args.false_positives)
        seconds = args.false_positives
        print(f"dry-run trainer, balanced, {seconds:g} s, 2 cores burnt: {named} rank(s) named slow")
        return {"false_positives": named}
    if args.megatron:
        return megatron_part(args.repeats, args.steps)
    if args.false_positives:
        work = Path(tempfile.mkdtemp(prefix="megaray-stragglers-"))
        with ray_cluster(nodes=2, cpus_per_node=2, gpus_per_node=2) as address:
            named = false_positives(address, work, args.false_positives)
        print(
            f"balanced run of {args.false_positives:g} s, 4 ranks, 2 cores burnt: {named} rank(s) named slow"
        )
        return {"false_positives": named}
    work = Path(tempfile.mkdtemp(prefix="megaray-stragglers-"))
    (work / "steps.py").write_text(STEPS)
    (work / "slow.py").write_text(SLOW_RANK)
    sys.path.insert(0, str(REPO))
    alone_on, alone_off = in_process()
    print(f"in one process, step ms: looked at {summary(alone_on)}; not {summary(alone_off)}; "
          f"ratio {median(alone_on) / median(alone_off):.4f}")  # fmt: skip
    on, off, names = [], [], []
    with ray_cluster(nodes=2, cpus_per_node=2, gpus_per_node=2) as address:
        for _ in range(args.repeats):
            off.append(step_ms(address, work / "steps.py", args.steps, watched=False))
            on.append(step_ms(address, work / "steps.py", args.steps, watched=True))
            names.append(time_to_name(address, work / "slow.py"))
    ratio = median(on) / median(off)
    print(f"step time, ms: watched {summary(on)}; not watched {summary(off)}; ratio {ratio:.4f}")
    print(f"rank 3 (4x as long a step) named after {summary([n for n, _ in names])} s; "
          f"stated slowdown {summary([s for _, s in names])}")  # fmt: skip
    return {"on": on, "off": off, "ratio": ratio, "named": names, "alone": (alone_on, alone_off)}


if __name__ == "__main__":
    main()
