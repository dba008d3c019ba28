"""In a warm spare (driver/spares.py): the rank's env, then the imports its rank will need, before the
rank it replaces has failed."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import time
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


def warm(env: dict[str, str], steps: tuple[str, ...]) -> dict[str, Any]:
    """In the spare: the rank's env first (OpenMP and CUDA read theirs when they load), then the
    imports. An import that fails is left to the rank, which reports it with its traceback."""
    os.environ.update(env)
    before = set(os.environ)
    # torch.cuda.is_available() through NVML, as a check at import must not create a CUDA context
    # beside the running rank's on this GPU (removed after with what the imports set).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    t0 = time.monotonic()
    failed: dict[str, str] = {}
    try:
        with _quiet():
            for step in steps:
                module, func = split_ref(step)
                try:
                    loaded = importlib.import_module(module)
                    if func:
                        getattr(loaded, func)()
                except Exception as e:
                    failed[step] = f"{type(e).__name__}: {e}".splitlines()[0]
    finally:
        # what an import put in the environment (torch's inductor its TORCHINDUCTOR_CACHE_DIR) is not
        # there for a program that does not import it: the rank's env must be what a cold start has
        for key in set(os.environ) - before:
            os.environ.pop(key, None)
    torch = sys.modules.get("torch")
    return {
        "seconds": round(time.monotonic() - t0, 2),
        "failed": failed,
        "cuda_initialized": bool(torch is not None and torch.cuda.is_initialized()),
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
