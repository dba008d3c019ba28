"""Control-plane scale: placement groups, actors and env for many ranks on simulated nodes with
declared GPUs, with a target that imports nothing, through `launch()`. Reports milliseconds per
rank for each phase, and torchrun spawning as many trivial workers on this machine, in the same run.

    python bench/control_plane.py --layouts 8x8 16x8 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import sys

from common import PY, REPO, median, ray_cluster, summary, timed

PHASES = ("placed", "actors_ready", "env_set", "finished", "torn_down")


def megaray_once(address: str, nodes: int, gpus: int) -> dict[str, float]:
    import ray

    sys.path.insert(0, str(REPO))
    from launcher.driver import launch
    from launcher.spec import spec_from_args

    os.chdir(REPO)
    ray.init(address=address, namespace="megaray", log_to_driver=False)
    try:
        spec = spec_from_args(["--nodes", str(nodes), "--gpus-per-node", str(gpus), "--cpus-per-rank", "0.01",
                               "--entrypoint", "bench.targets:noop"])  # fmt: skip
        result = launch(spec)
        assert list(result.returns) == list(range(nodes * gpus))
        return result.timings
    finally:
        ray.shutdown()


def torchrun_once(ranks: int) -> float:
    t0, p = timed([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   "--no-python", "true"])  # fmt: skip
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    import time

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
        total = [r["torn_down"] for r in runs]
        print(f"  megaray total {1000 * median(total) / ranks:8.1f} ms/rank; {summary(total)} s", flush=True)
        print(f"  torchrun (spawn {ranks} trivial workers) {1000 * median(tr) / ranks:8.1f} ms/rank; "
              f"{summary(tr)} s", flush=True)  # fmt: skip
    return results


if __name__ == "__main__":
    main()
