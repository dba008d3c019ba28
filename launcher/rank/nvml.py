"""What a rank's process may learn of the node's GPUs without a CUDA context: NVML, the driver's
management library (what nvidia-smi reads), called through ctypes: it is on every node with an
NVIDIA driver, while its Python binding (nvidia-ml-py) may not be installed. A CUDA context costs
about 500 MiB of the GPU and, made before the rank picks its device, sits on the node's first GPU."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class NvmlError(Exception):
    pass


def _check(code: int) -> None:
    if code != 0:
        raise NvmlError(f"NVML error {code}")


@contextlib.contextmanager
def _devices() -> Iterator[tuple[ctypes.CDLL, list[ctypes.c_void_p]]]:
    """The library and a handle per GPU of the node; raises OSError or NvmlError where there is none."""
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    _check(lib.nvmlInit_v2())
    try:
        count = ctypes.c_uint()
        _check(lib.nvmlDeviceGetCount_v2(ctypes.byref(count)))
        handles = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            _check(lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(handle)))
            handles.append(handle)
        yield lib, handles
    finally:
        lib.nvmlShutdown()


def compute_capability() -> tuple[int, int] | None:
    """The compute capability every GPU of this node has; None without a driver or GPUs, or when the
    node's GPUs differ (then the device a caller means matters, and only CUDA can say)."""
    try:
        with _devices() as (lib, handles):
            caps = set()
            for h in handles:
                major, minor = ctypes.c_int(), ctypes.c_int()
                _check(lib.nvmlDeviceGetCudaComputeCapability(h, ctypes.byref(major), ctypes.byref(minor)))
                caps.add((major.value, minor.value))
    except (OSError, NvmlError, AttributeError):  # no driver (a CPU node), an old one, an NVML error
        return None
    return caps.pop() if len(caps) == 1 else None


def smallest_memory_gib() -> float | None:
    """The memory of the node's smallest GPU, in GiB (the preflight's check against the GPUs a
    launch got: megatron/runners.py); None without a driver or GPUs."""
    try:
        with _devices() as (lib, handles):
            totals = []
            for h in handles:
                mem = _Memory()
                _check(lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem)))
                totals.append(mem.total)
    except (OSError, NvmlError, AttributeError):
        return None
    return round(min(totals) / 2**30, 2) if totals else None
