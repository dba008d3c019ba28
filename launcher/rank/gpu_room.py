"""In a warm spare: when the GPU of the rank it replaces has room for it, before that rank's process
is gone.

A process that held GPU memory takes seconds to exit (the driver frees its memory as it goes: 5.4 s
for a 4 GB model on an H100), and a spare that waited for it to be gone would add all of it to the
restart. The spare watched its rank's GPU while the rank trained (NVML, no CUDA context): once the
GPU has as much free as the rank ever used there, with a margin, the new rank fits beside what the
old one still holds. Where the GPU allows one process at a time (an exclusive compute mode), or
nothing was seen, the spare waits for the process to be gone, as before.
"""

from __future__ import annotations

import threading

from .nvml import DEFAULT_COMPUTE_MODE, memory_use
from .probes import process_state, wait_gone

SAMPLE_EVERY_S = 1.0
MARGIN = 1.1  # of the most the rank used: the caching allocator's growth after the first steps
MARGIN_BYTES = 1 << 30  # a CUDA context and NCCL's buffers beside the model


def room_problem(peak_used: int | None, free: int, mode: int) -> str | None:
    """Why a GPU that the old rank used up to `peak_used` bytes has no room yet for its successor,
    or None."""
    if mode != DEFAULT_COMPUTE_MODE:
        return f"compute mode {mode} takes one process at a time"
    if peak_used is None:
        return "what the rank used there was not seen"
    need = int(peak_used * MARGIN) + MARGIN_BYTES
    if free < need:
        return f"{free / 2**30:.1f} GiB free of the {need / 2**30:.1f} GiB it needs"
    return None


class GpuUse:
    """The most memory seen in use on some GPUs of the node (by Ray GPU id = NVML index), sampled in
    a thread while the rank trains."""

    def __init__(self, gpu_ids: list[str] | tuple[str, ...]):
        self.indices = [int(g) for g in gpu_ids]
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="megaray-gpu-use", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.read()
            self._stop.wait(SAMPLE_EVERY_S)

    def read(self) -> None:
        use = memory_use()
        for i in self.indices:
            if use is not None and i < len(use):
                self.peak[i] = max(self.peak.get(i, 0), use[i][0])

    def stop(self) -> None:
        self._stop.set()

    def problem(self) -> str | None:
        """Why the GPUs have no room yet for the rank's successor (None: they have)."""
        use = memory_use()
        if not use or not self.indices:
            return "no GPU to look at"
        for i in self.indices:
            if i >= len(use):
                return f"no GPU {i}"
            _, free, mode = use[i]
            if problem := room_problem(self.peak.get(i), free, mode):
                return problem
        return None


def wait_replaced(pid: int, gpus: GpuUse | None, timeout_s: float) -> str:
    """Wait for the process a spare replaces to be gone, or its GPUs to have room for the spare's
    rank (`gpus`: what the spare saw the rank use); says which, or that the wait timed out."""
    if gpus is not None:
        gpus.stop()
    room = (lambda: gpus.problem() is None) if gpus is not None else None
    if not wait_gone(pid, timeout_s, room):
        return "timed out"
    return "gone" if process_state(pid) in (None, "Z") else "room on its GPU"
