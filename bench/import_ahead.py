"""A rank's imports ahead, the cold start's longest part: where they run, and with Python's cyclic
garbage collector on or paused (#44). The same modules each way, interleaved and repeated:
  process     a plain `python` importing them, as torchrun's worker does
  actor       a Ray actor running a launch's imports ahead (rank/warmup.py `warm`), collector paused
  actor-gc    the same with the collector on throughout (megaray before the pause)
on a running Ray (no Ray start in the figures). Each figure is the imports' own seconds, timed where
they run. The default modules are the Megatron target's for `--recipe gpt_small`
(megatron/runners.py `MegatronRunner.warm_imports`).

    python bench/import_ahead.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import PY, REPO, clean_env, ray_cluster, summary

STEPS = (
    "torch",
    "torch.distributed",
    "launcher.megatron.compat:import_bridge",
    "megatron.bridge.training.gpt_step",
    "megatron.bridge.training.pretrain",
    "megatron.bridge.recipes.gpt.vanilla_gpt",
    "launcher.megatron.bridge_target",
)
MODES = ("process", "actor", "actor-gc")
# A plain process, timed inside: an import that fails (pretrain's, without nvidia-resiliency-ext) is
# passed over, as a rank's imports ahead pass it over to the program.
PLAIN = """
import importlib, sys, time
t0 = time.monotonic()
for step in sys.argv[1:]:
    module, _, func = step.partition(":")
    try:
        loaded = importlib.import_module(module)
        if func:
            getattr(loaded, func)()
    except Exception:
        pass
print(round(time.monotonic() - t0, 2))
"""


class Importer:
    """One fresh Ray worker process per figure, as a rank's."""

    def __init__(self, repo: str):
        sys.path.insert(0, repo)

    def run(self, steps: tuple[str, ...], collector: bool) -> float:
        import contextlib

        from launcher.rank import warmup

        if collector:  # as before the pause: the collector stays on
            warmup.collector_paused = contextlib.nullcontext
        return warmup.warm({}, steps, own_program_next=True)["seconds"]


def one(mode: str, steps: tuple[str, ...], importer_class) -> float:
    import ray

    if mode == "process":
        env = {**clean_env(), "CUDA_VISIBLE_DEVICES": ""}
        p = subprocess.run([PY, "-c", PLAIN, *steps], env=env, capture_output=True, text=True, check=True)
        return float(p.stdout.split()[-1])
    actor = importer_class.options(runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}).remote(str(REPO))
    try:
        return ray.get(actor.run.remote(steps, mode == "actor-gc"))
    finally:
        ray.kill(actor)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", nargs="+", default=list(STEPS), help="modules (module:function) to import")
    args = p.parse_args(argv)
    import ray

    steps = tuple(args.steps)
    figures: dict[str, list[float]] = {m: [] for m in args.modes}
    with ray_cluster(nodes=1, cpus_per_node=os.cpu_count() or 2) as address:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        importer_class = ray.remote(num_cpus=1)(Importer)
        try:
            for r in range(args.repeats):
                # each repeat starts with a different mode: none is always the one after another's
                order = args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]
                for mode in order:
                    figures[mode].append(one(mode, steps, importer_class))
                    print(f"repeat {r + 1} {mode}: {figures[mode][-1]:.2f} s", flush=True)
        finally:
            ray.shutdown()
    out = {"steps": steps, "seconds": figures}
    print(json.dumps(out))
    for mode, values in figures.items():
        print(f"{mode:10s} {summary(values)} s")
    return out


if __name__ == "__main__":
    main()
