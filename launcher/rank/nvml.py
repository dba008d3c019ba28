"""What a rank's process may learn of the node's GPUs without a CUDA context: NVML, the driver's
management library (what nvidia-smi reads), called through ctypes: it is on every node with an
NVIDIA driver, while its Python binding (nvidia-ml-py) may not be installed. A CUDA context costs
about 500 MiB of the GPU and, made before the rank picks its device, sits on the node's first GPU."""

from __future__ import annotations

import ctypes
from collections.abc import Callable


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class NvmlError(Exception):
    pass


def _check(code: int) -> None:
    if code != 0:
        raise NvmlError(f"NVML error {code}")


def _each_gpu[T](read: Callable[[ctypes.CDLL, ctypes.c_void_p], T]) -> list[T] | None:
    """`read(library, handle)` for every GPU of the node, in NVML's order; None where there is no
    driver (a CPU node), an old one, or an NVML error."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        _check(lib.nvmlInit_v2())
    except (OSError, NvmlError, AttributeError):
        return None
    try:
        count = ctypes.c_uint()
        _check(lib.nvmlDeviceGetCount_v2(ctypes.byref(count)))
        out = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            _check(lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(handle)))
            out.append(read(lib, handle))
        return out
    except (NvmlError, AttributeError):
        return None
    finally:
        lib.nvmlShutdown()


def _capability(lib: ctypes.CDLL, handle: ctypes.c_void_p) -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)))
    return major.value, minor.value


def _total_memory(lib: ctypes.CDLL, handle: ctypes.c_void_p) -> int:
    mem = _Memory()
    _check(lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)))
    return mem.total


def compute_capability() -> tuple[int, int] | None:
    """The compute capability every GPU of this node has; None without a driver or GPUs, or when the
    node's GPUs differ (then the device a caller means matters, and only CUDA can say)."""
    caps = set(_each_gpu(_capability) or ())
    return caps.pop() if len(caps) == 1 else None


def smallest_memory_gib() -> float | None:
    """The memory of the node's smallest GPU, in GiB (the preflight's check against the GPUs a
    launch got: megatron/runners.py); None without a driver or GPUs."""
    totals = _each_gpu(_total_memory)
    return round(min(totals) / 2**30, 2) if totals else None


DEFAULT_COMPUTE_MODE = 0  # any process may make a context; exclusive modes allow one at a time


def _memory_and_mode(lib: ctypes.CDLL, handle: ctypes.c_void_p) -> tuple[int, int, int]:
    mem, mode = _Memory(), ctypes.c_int()
    _check(lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)))
    _check(lib.nvmlDeviceGetComputeMode(handle, ctypes.byref(mode)))
    return mem.used, mem.free, mode.value


def memory_use() -> list[tuple[int, int, int]] | None:
    """(used bytes, free bytes, compute mode) of every GPU of the node, in NVML's order (the indices
    Ray's GPU ids are); None without a driver or GPUs."""
    return _each_gpu(_memory_and_mode)
