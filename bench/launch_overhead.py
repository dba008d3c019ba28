"""Launch overhead against torchrun: from the command to every rank past init_process_group and a
barrier, on CPU with gloo, for megaray attached to a running cluster, megaray with a `megaray up`
running (no address given; the launch takes the processes its pool started), the same with
`megaray up --warm` (torch imported there), megaray starting its own local Ray, and
`torchrun --standalone`, measured in the same run, interleaved, repeated. After a launch that took a
pool, the next measurement waits until the pool is refilled: a refill would take CPU from it.

    python bench/launch_overhead.py --ranks 2 4 8 16 --repeats 3

`--first-step` measures instead the time to the first training step of the dry-run trainer (the
rendezvous check, then a tiny Megatron GPT on CPU; bench/first_step.py under torchrun, `--dry-run`
under megaray), where the warm pool saves the megatron-core import as well as torch's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from common import PY, REPO, clean_env, median, ray_cluster, summary, timed

TARGET = str(REPO / "bench" / "barrier.py")
FIRST_STEP = str(REPO / "bench" / "first_step.py")
STEPS = "steps=3"
MODES = ("torchrun", "megaray-attached", "megaray-up", "megaray-up-warm", "megaray-own-ray")


def one(cmd: list[str], ranks: int) -> tuple[float, float, float]:
    """Seconds from starting `cmd` to the last rank past the barrier, the median CPU seconds a
    rank's process had used by then, and seconds until the command itself exited."""
    out = Path(tempfile.mkdtemp(prefix="megaray-barrier-"))
    try:
        t0, p = timed([*cmd, TARGET, "--out", str(out)])
        ended = time.time()
        if p.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
            )
        stamps = [tuple(map(float, f.read_text().split())) for f in out.iterdir()]
        if len(stamps) != ranks:
            raise RuntimeError(f"{len(stamps)} of {ranks} ranks reported")
        return max(at for at, _ in stamps) - t0, median([cpu for _, cpu in stamps]), ended - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)


@contextlib.contextmanager
def megaray_up(ranks: int, *extra: str):
    """`megaray up` for the run, in a state folder of its own (the other modes do not see it)."""
    state = tempfile.mkdtemp(prefix="mrb-", dir="/tmp")
    env = {**clean_env(), "MEGARAY_STATE_DIR": state}
    up = [PY, str(REPO / "main.py"), "up", "--nodes", "1", "--gpus-per-node", str(ranks), *extra]
    p = subprocess.run(up, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"megaray up failed:\n{p.stderr[-3000:]}")
    try:
        yield state
    finally:
        subprocess.run(
            [PY, str(REPO / "main.py"), "down"], cwd=REPO, env=env, capture_output=True, timeout=120
        )
        shutil.rmtree(state, ignore_errors=True)


def _up_if(ranks: int, wanted: bool, *extra: str):
    return megaray_up(ranks, *extra) if wanted else contextlib.nullcontext("")


def commands(n: int, wanted: list[str], address: str, state: str, warm: str) -> dict[str, list[str]]:
    megaray = [
        PY,
        str(REPO / "main.py"),
        "--device",
        "cpu",
        "--cpus-per-rank",
        "0.1",
        "--gpus-per-node",
        str(n),
    ]
    modes = {
        "torchrun": [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)],
        "megaray-attached": [*megaray, "--address", address],
        "megaray-up": ["env", f"MEGARAY_STATE_DIR={state}", *megaray],
        "megaray-up-warm": ["env", f"MEGARAY_STATE_DIR={warm}", *megaray],
        "megaray-own-ray": megaray,
    }
    return {m: cmd for m, cmd in modes.items() if m in wanted}


def measure(
    n: int, wanted: list[str], repeats: int, address: str, state: str, warm: str, to_first_step: bool = False
) -> dict:
    """Every mode `repeats` times, interleaved (drift on a shared machine hits all): to the barrier, or
    with `to_first_step` to the dry-run trainer's first step."""
    modes = commands(n, wanted, address, state, warm)
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    exits: dict[str, list[float]] = {m: [] for m in modes}
    order = [mode for _ in range(repeats) for mode in modes]
    for i, mode in enumerate(order):
        cmd = modes[mode]
        if to_first_step:
            times[mode].append(first_step(cmd, mode != "torchrun"))
        else:
            seconds, cpu, exited = one(cmd, n)
            times[mode].append(seconds)
            cpus[mode].append(cpu)
            exits[mode].append(exited)
        # its refill done before the next measurement; after the last one, `megaray down` ends it
        if mode in ("megaray-up", "megaray-up-warm") and i + 1 < len(order):
            pool_ready(warm if mode == "megaray-up-warm" else state)
    base = median(times["torchrun"])
    to = ", to the dry-run trainer's first step" if to_first_step else ""
    print(f"{n} ranks{to}:", flush=True)
    for mode, ts in times.items():
        diff = (
            ""
            if mode == "torchrun"
            else f"  {median(ts) - base:+.2f} s vs torchrun ({median(ts) / base:.2f}x)"
        )
        cpu = f"; a rank's CPU by the barrier {median(cpus[mode]):.2f} s" if cpus[mode] else ""
        ended = ""
        if exits[mode]:
            ratio = median(exits[mode]) / median(exits["torchrun"])
            ended = f"; command exited at {median(exits[mode]):.2f} s ({ratio:.2f}x)"
        print(f"  {mode:17s} {summary(ts)} s{diff}{cpu}{ended}", flush=True)
    return {
        m: {"seconds": times[m], **({"rank_cpu": cpus[m], "exit_seconds": exits[m]} if cpus[m] else {})}
        for m in modes
    }


def pool_ready(state: str, timeout: float = 180, every_s: float = 2.0) -> None:
    """Wait until the pool of the `megaray up` in `state` is ready (refilled after the last launch):
    a refill in the background would otherwise take CPU from whatever is measured meanwhile. Asked
    every `every_s`: each `megaray list` is a process that imports Ray (~0.6 CPU-s), which a refill
    importing torch on 2 cores shares them with."""
    env = {**clean_env(), "MEGARAY_STATE_DIR": state}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = subprocess.run([PY, str(REPO / "main.py"), "list"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        if ", ready: " in p.stdout:
            time.sleep(1)  # its output sink, started beside it
            return
        time.sleep(every_s)
    raise RuntimeError(f"the pool of `megaray up` in {state} was not ready within {timeout:g} s")


def first_step(cmd: list[str], megaray: bool) -> float:
    """Seconds from starting `cmd` to the first training step reported."""
    out = Path(tempfile.mkdtemp(prefix="megaray-first-step-"))
    try:
        if megaray:
            t0, p = timed([*cmd, "--runs-dir", str(out), "--job-name", "fs", "--dry-run", STEPS])
        else:
            t0, p = timed([*cmd, FIRST_STEP, str(out / "first"), STEPS])
        if p.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
            )
        if megaray:
            return json.loads((out / "fs" / "summary.json").read_text())["progress"]["first_report_at"] - t0
        return float((out / "first").read_text()) - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--first-step", action="store_true", help="to the dry-run trainer's first step")
    args = parser.parse_args(argv)
    results: dict = {}
    # a cluster running beside for the attached mode only: the others would share the CPUs with it
    if "megaray-attached" in args.modes:
        beside = ray_cluster(nodes=1, cpus_per_node=max(args.ranks))
    else:
        beside = contextlib.nullcontext("")
    with beside as address:
        for n in args.ranks:
            # a pool holds one layout: a `megaray up` (and a `megaray up --warm`) for each rank count
            with (
                _up_if(n, "megaray-up" in args.modes) as state,
                _up_if(n, "megaray-up-warm" in args.modes, "--warm") as warm,
            ):
                results[n] = measure(n, args.modes, args.repeats, address, state, warm, args.first_step)
    return results


if __name__ == "__main__":
    main()
