"""In a warm spare (driver/gang/spares.py): the rank's env, then the imports its rank will need, before the
rank it replaces has failed."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from ..core.refs import split_ref


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


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a stack imports, as it was after.

    Importing Megatron-Bridge makes ~800,000 objects, nearly all kept for the process's life; each
    generation-2 collection meanwhile walks all of them (0.4 s at the end, on 2 cores) and finds next
    to nothing: the same imports took 10.3-10.9 s without the collector against 11.0-12.2 s with it,
    three runs each, for ~20,000 garbage objects (~12 MB) left to the next collection. torchrun's
    worker pays that in full; the pause is over before the rank's program runs."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class CudaQueries:
    """While the warm imports run, torch's device queries answered without a CUDA context.

    nvidia-modelopt, which Megatron-Bridge imports, asks `torch.cuda.get_device_capability()` at
    import (to choose its Hopper kernels); torch answers by making a context on the current device,
    the node's first GPU, before the rank has picked its own: in a spare, beside the running rank's.
    NVML answers the same question without one (rank/nvml.py), where every GPU of the node agrees.
    Whatever still initializes CUDA is let through (a wrong answer would be baked into a module) and
    its place recorded, so the spare can say why it cannot take over."""

    def __init__(self):
        self.torch: Any = None
        self.saved: dict[str, Any] = {}
        self.initialized_at: str | None = None

    def install(self) -> None:
        """Once torch is imported (the imports start with it); again is a no-op."""
        torch = sys.modules.get("torch")
        if torch is None or self.torch is not None or torch.cuda.is_initialized():
            return
        self.torch = torch
        if not torch.cuda.is_available():  # through NVML here: no GPU, nothing to shield
            return
        from .nvml import compute_capability

        cuda = torch.cuda
        self.saved = {"get_device_capability": cuda.get_device_capability, "_lazy_init": cuda._lazy_init}
        if (cap := compute_capability()) is not None:
            cuda.get_device_capability = lambda device=None: cap
        real_init = self.saved["_lazy_init"]

        def lazy_init() -> None:
            if self.initialized_at is None and not cuda.is_initialized():
                self.initialized_at = _caller_outside(os.path.dirname(torch.__file__))
            real_init()

        cuda._lazy_init = lazy_init

    def restore(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.torch.cuda, name, fn)
        self.saved = {}


def _caller_outside(folder: str) -> str:
    """`file:line` of the innermost frame not in `folder` (torch's own), nor in this file."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(folder) and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def warm(
    env: dict[str, str], steps: tuple[str, ...], own_program_next: bool = False, prepare: Any = None
) -> dict[str, Any]:
    """The rank's env first (OpenMP and CUDA read theirs when they load), then the imports. An
    import that fails is left to the rank, which reports it with its traceback.

    In a spare or a pool's process the imports' warnings are not shown (the ranks printed them) and
    what they set in the environment goes (a program that does not import them would not have it);
    `own_program_next`: a rank whose program, which imports the same, runs next (driver/lifecycle/attempt.py
    `import_ahead`): both stay, as if the program had imported them itself. `prepare`: (runner,
    target), whose `prepare` then runs (core/runner.py: a Megatron recipe's config built ahead)."""
    quiet = not own_program_next
    os.environ.update(env)
    before = set(os.environ)
    # torch.cuda.is_available() through NVML, as a check at import must not create a CUDA context
    # beside the running rank's on this GPU (removed after with what the imports set).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    t0 = time.monotonic()
    failed: dict[str, str] = {}
    prepared_s = None
    queries = CudaQueries()
    try:
        with _quiet() if quiet else contextlib.nullcontext(), collector_paused():
            for step in steps:
                module, func = split_ref(step)
                try:
                    loaded = importlib.import_module(module)
                    if func:
                        getattr(loaded, func)()
                except Exception as e:
                    failed[step] = f"{type(e).__name__}: {e}".splitlines()[0]
                queries.install()
            if prepare is not None:
                t1 = time.monotonic()
                runner, target = prepare
                runner.prepare(target)
                prepared_s = round(time.monotonic() - t1, 2)
    finally:
        queries.restore()
        # what an import put in the environment (torch's inductor its TORCHINDUCTOR_CACHE_DIR) is not
        # there for a program that does not import it: the rank's env must be what a cold start has
        for key in set(os.environ) - before if quiet else {"PYTORCH_NVML_BASED_CUDA_CHECK"} - before:
            os.environ.pop(key, None)
    torch = sys.modules.get("torch")
    return {
        "seconds": round(time.monotonic() - t0, 2),
        "prepared_s": prepared_s,
        "failed": failed,
        "cuda_initialized": bool(torch is not None and torch.cuda.is_initialized()),
        "cuda_initialized_at": queries.initialized_at,
    }


def expire_when_idle(actor: Any, group_name: str, idle_timeout_s: float, sinks: str | None = None) -> None:
    """A pool's process holds its bundle (GPUs too) for `idle_timeout_s` unless a launch claims it;
    then its placement group is removed, which ends every process of the pool on that node, and the
    pool's output sinks (named `sinks`...) are stopped."""
    if not idle_timeout_s:
        return

    def expire() -> None:
        time.sleep(idle_timeout_s)
        if actor.claimed_by is None:
            import ray
            from ray.util import get_placement_group, remove_placement_group

            # the sinks first: removing the group ends this very process, with this thread
            for name in ray.util.list_named_actors() if sinks else ():
                if name.startswith(sinks):
                    with contextlib.suppress(Exception):
                        ray.kill(ray.get_actor(name), no_restart=True)
            with contextlib.suppress(Exception):
                remove_placement_group(get_placement_group(group_name))
            with contextlib.suppress(Exception):
                ray.actor.exit_actor()

    threading.Thread(target=expire, name="megaray-pool-idle", daemon=True).start()
