"""megatron-core on CPU over gloo, for the dry run: the few places it assumes CUDA, redirected.

Only Megatron modules are touched, and only inside this process: a handful of megatron-core
modules create tensors on "cuda" or ask `torch.cuda` for the current device or stream; their
module-level name `torch` is rebound to a proxy that answers those on CPU. Global torch is never
changed. The CUDA RNG tracker (attention forks it even with dropout 0) gets a CPU-generator twin.
Everything here is a no-op for code that already runs on CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any

import torch

# megatron-core modules with hard-coded CUDA devices, streams or `torch.cuda` calls on the paths
# that the dry-run trainer takes (pipeline schedules and p2p, DDP buffers, optimizer, rotary
# embeddings, the global memory buffer in utils).
CUDA_MODULES = (
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.transformer.module",
)


def _cpu_device(device: Any) -> Any:
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _Stream:
    """Stands in for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *_args, **_kwargs):
        pass

    def wait_stream(self, *_args, **_kwargs):
        pass

    def wait_event(self, *_args, **_kwargs):
        pass

    def record_event(self, *_args, **_kwargs):
        return _Stream()

    def record(self, *_args, **_kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, _other):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        return False


class _CpuCuda(types.SimpleNamespace):
    """What those modules ask of `torch.cuda`, answered for CPU."""

    def __init__(self):
        super().__init__(
            Stream=_Stream,
            Event=_Stream,
            current_device=lambda: torch.device("cpu"),
            current_stream=lambda *_a, **_k: _Stream(),
            default_stream=lambda *_a, **_k: _Stream(),
            stream=lambda *_a, **_k: contextlib.nullcontext(),
            synchronize=lambda *_a, **_k: None,
            is_available=lambda: False,
            device_count=lambda: 0,
            empty_cache=lambda: None,
            memory_allocated=lambda *_a, **_k: 0,
            max_memory_allocated=lambda *_a, **_k: 0,
            nvtx=types.SimpleNamespace(range_push=lambda *_a, **_k: None, range_pop=lambda *_a, **_k: None),
            get_device_properties=lambda *_a, **_k: types.SimpleNamespace(multi_processor_count=1),
            FloatTensor=torch.FloatTensor,
            IntTensor=torch.IntTensor,
            LongTensor=torch.LongTensor,
        )

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "empty_like",
              "zeros_like", "ones_like", "full_like", "as_tensor")  # fmt: skip


class _CpuTorch(types.ModuleType):
    """`torch`, as seen from one megatron module: tensor factories put "cuda" tensors on CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn):
        def on_cpu(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        return on_cpu

    def device(self, kind, index=None):
        return torch.device("cpu") if (kind == "cuda" or isinstance(kind, int)) else torch.device(kind, index)

    def __getattr__(self, name):
        return getattr(torch, name)


class CpuRNGStatesTracker:
    """The CUDA RNG tracker's interface on CPU generators (forks swap the CPU RNG state)."""

    def __init__(self, *_args, **_kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def adapt_megatron_to_cpu() -> None:
    """Call once per process, before building a megatron-core model on CPU."""
    from megatron.core import jit
    from megatron.core.tensor_parallel import random

    jit.disable_jit_fuser()
    proxy = _CpuTorch()
    for name in CUDA_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = proxy
    random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
