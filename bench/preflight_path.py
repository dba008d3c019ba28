"""What the preflight costs on a Megatron-Bridge launch's critical path, on any machine (CPU ranks).

The same rank program, three ways, interleaved and repeated, from the command to its end:
  recipe     `megaray --recipe gpt_small`: the preflight (its own process) beside connecting and the
             rank importing bridge; the program starts at the verdict
  no-check   megaray running the same program as a plain module (`-m launcher.megatron.bridge_target
             --recipe gpt_small`): no preflight at all, the rank imports bridge itself
  torchrun   `torchrun --standalone -m launcher.megatron.bridge_target --recipe gpt_small`
megaray runs attached to one running Ray (no Ray start in the figures). The program builds the
config and starts `pretrain()`, which cannot train on a CPU: it ends there (on a machine without
nvidia-resiliency-ext, at pretrain's import), the same point in all three. `recipe` minus `no-check`
is what the preflight adds to the critical path (the goal: under 1 s); `no-check` against
`torchrun` is the launcher's own cost.

    python bench/preflight_path.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from common import PY, REPO, median, ray_cluster, summary, timed

RECIPE = ["--recipe", "gpt_small", "train.train_iters=2"]
MODES = ("recipe", "no-check", "torchrun")


def command(mode: str, address: str) -> list[str]:
    megaray = [PY, str(REPO / "main.py"), "--address", address, "--device", "cpu", "--nodes", "1",
               "--gpus-per-node", "1", "--job-name", f"bench-{mode}-{time.monotonic_ns()}",
               "--runs-dir", "/tmp/megaray-bench-runs"]  # fmt: skip
    if mode == "recipe":
        return [*megaray, *RECIPE]
    module = ["-m", "launcher.megatron.bridge_target"]
    if mode == "no-check":
        return [*megaray, *module, *RECIPE]
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *module, *RECIPE]


def one(mode: str, address: str) -> dict[str, float | int | str]:
    t0, p = timed(command(mode, address))
    out = {"seconds": time.time() - t0, "exit": p.returncode}
    text = p.stdout + p.stderr
    for line in text.splitlines():
        if "waited" in line and "for the preflight" in line:
            out["waited"] = line.split("waited", 1)[1].split("s for", 1)[0].strip()
        if "preflight in rank 0's process" in line:
            out["answered_by"] = "rank 0"
    # the same end for all three: pretrain() starting (ModuleNotFoundError of its import here)
    out["reached_pretrain"] = int("in train_recipe" in text)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = p.parse_args(argv)
    results: dict[str, list] = {m: [] for m in args.modes}
    with ray_cluster(nodes=1, cpus_per_node=2) as address:
        one(args.modes[0], address)  # once, unmeasured: no mode pays alone for a cold file cache
        for r in range(args.repeats):
            order = args.modes if r % 2 == 0 else list(reversed(args.modes))
            for mode in order:
                results[mode].append(one(mode, address))
                print(mode, results[mode][-1], flush=True)
    seconds = {m: [x["seconds"] for x in v] for m, v in results.items()}
    for m, v in seconds.items():
        print(f"{m:9s} {summary(v)} s")
    if {"recipe", "no-check"} <= set(seconds):
        print(f"the preflight adds {median(seconds['recipe']) - median(seconds['no-check']):+.2f} s (median)")
    if {"no-check", "torchrun"} <= set(seconds):
        ratio = median(seconds["no-check"]) / median(seconds["torchrun"])
        print(f"megaray / torchrun, no preflight: {ratio:.2f}")
    if {"recipe", "torchrun"} <= set(seconds):
        print(f"megaray --recipe / torchrun: {median(seconds['recipe']) / median(seconds['torchrun']):.2f}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
