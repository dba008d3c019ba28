"""What a rank's process may learn of the node's GPUs without a CUDA context: NVML (nvidia-ml-py,
which nvidia-modelopt and so Megatron-Bridge require). A context costs about 500 MiB of the GPU
and, made before the rank picks its device, sits on the node's first GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def _nvml() -> Iterator[Any]:
    import pynvml

    pynvml.nvmlInit()
    try:
        yield pynvml
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def compute_capability() -> tuple[int, int] | None:
    """The compute capability every GPU of this node has; None without NVML, without GPUs, or when
    the node's GPUs differ (then the device a caller means matters, and only CUDA can say)."""
    try:
        with _nvml() as nv:
            caps = {
                tuple(nv.nvmlDeviceGetCudaComputeCapability(nv.nvmlDeviceGetHandleByIndex(i)))
                for i in range(nv.nvmlDeviceGetCount())
            }
    except Exception:  # no pynvml, no driver (a CPU node), an NVML error
        return None
    return caps.pop() if len(caps) == 1 else None  # type: ignore[return-value]


def smallest_memory_gib() -> float | None:
    """The memory of the node's smallest GPU, in GiB (the preflight's check against the GPUs a
    launch got: megatron/runners.py); None without NVML or GPUs."""
    try:
        with _nvml() as nv:
            totals = [
                nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).total
                for i in range(nv.nvmlDeviceGetCount())
            ]
    except Exception:
        return None
    return round(min(totals) / 2**30, 2) if totals else None
