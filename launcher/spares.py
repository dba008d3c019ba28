"""Warm spares: the next attempt's rank actors, started while this attempt runs, with torch and the
Megatron stack already imported, so that a restart skips Ray's worker start, the imports and the
placement.

A restart under torchrun (or a cold relaunch here) pays, per rank, a new Python process and the
imports again (torch alone is seconds, torch plus megatron-core about ten on a small machine), then
waits for placement. A spare is started into the same bundle as its rank, with no resources of its
own: the bundle keeps the GPU reserved, the spare uses it by index once its rank is gone, exactly as
the rank did (CUDA_VISIBLE_DEVICES lists the node's job GPUs, LOCAL_RANK picks one). Removing the
group kills the spare with it, so nothing outlives the job.

A spare is used only if every one of them answers and every group is still placed; otherwise (a
node was lost, a spare died) the relaunch places everything anew, as it would without spares.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .spec import Target

# The Megatron dry run's imports (launcher.tiny_gpt imports them inside `train`).
DRY_RUN_IMPORTS = (
    "megatron.core.parallel_state",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
    "launcher.tiny_gpt",
    "launcher.cpu_megatron",
)


def warm_steps(target: Target) -> tuple[str, ...]:
    """What a spare imports before its rank needs it: `module`, or `module:function` to call.

    Only the launcher's own stack: a user's script or module is never run ahead of time (its
    import-time code would run with the previous attempt's env).
    """
    steps = ("torch", "torch.distributed")
    if target.kind == "dryrun":
        return (*steps, *DRY_RUN_IMPORTS)
    if target.kind == "megatron" and target.recipe is not None:
        recipe_module = target.recipe.function.partition(":")[0]
        return (
            *steps,
            "launcher.compat:import_bridge",  # the TE-less import order, where TE is missing
            "megatron.bridge.training.gpt_step",
            "megatron.bridge.training.pretrain",
            recipe_module,
            "launcher.bridge_target",
        )
    return steps


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The imports' warnings were printed by the attempt's ranks already: keep them out of the logs."""
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def warm(env: dict[str, str], steps: tuple[str, ...]) -> dict[str, Any]:
    """In the spare: the rank's env first (OpenMP and CUDA read theirs when they load), then the
    imports. An import that fails is left to the rank, which reports it with its traceback."""
    os.environ.update(env)
    # torch.cuda.is_available() through NVML, as a check at import must not create a CUDA context
    # beside the running rank's on this GPU.
    nvml_check = "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    if nvml_check:
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    t0 = time.monotonic()
    failed: dict[str, str] = {}
    try:
        with _quiet():
            for step in steps:
                module, _, func = step.partition(":")
                try:
                    loaded = importlib.import_module(module)
                    if func:
                        getattr(loaded, func)()
                except Exception as e:
                    failed[step] = f"{type(e).__name__}: {e}".splitlines()[0]
    finally:
        if nvml_check:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    torch = sys.modules.get("torch")
    return {
        "seconds": round(time.monotonic() - t0, 2),
        "failed": failed,
        "cuda_initialized": bool(torch is not None and torch.cuda.is_initialized()),
    }


@dataclass
class Spares:
    """The next attempt's actors (rank order) and what they keep from this attempt: its groups, the
    rank slots in them, each rank's GPU ids (a spare holds none of its own) and its process id (gone
    before the spare touches the GPU)."""

    actors: list
    warm_refs: list
    groups: list
    slots: list
    gpu_ids: list[list[str]]
    replaces_pids: list[int]
    started_at: float

    def kill(self, *, groups: bool) -> None:
        import ray

        from . import placement

        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        if groups:
            placement.remove_groups(self.groups)
