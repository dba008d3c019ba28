"""What megatron-core 0.19.2 and megatron-bridge 0.6.2 need to run on the machines users have.

Each fix is guarded by a check of what is installed, touches only Megatron modules, and is a no-op
where the problem does not exist (a real TransformerEngine is always used when installed):

- TransformerEngine absent: bridge's `peft/lora_layers.py` imports `transformer_engine.pytorch`
  unconditionally, so `import megatron.bridge` fails. That one module is executed with an import
  function that answers the TE import with a placeholder; the placeholder never enters
  `sys.modules`, so megatron-core's own `try: import transformer_engine` checks still see no TE.
  Models then use the local layer spec with the fusions that need compiled kernels off.
- The megatron-core wheel ships the compiled dataset helpers but not the Makefile that bridge's
  `initialize_megatron` runs through `compile_helpers()`; `make` fails and it calls `sys.exit(1)`.
  With the helpers importable, compiling is skipped.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_LORA = "megatron.bridge.peft.lora_layers"
FUSIONS_NEEDING_KERNELS = (
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",  # with cross_entropy_fusion_impl="te" (Qwen3), TE's kernel
)


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it.

    `find_spec("a.b")` imports `a` and raises when `a` is missing, so the top-level name is looked
    up first.
    """
    top = module.partition(".")[0]
    if importlib.util.find_spec(top) is None:
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def te_installed() -> bool:
    return installed("transformer_engine")


class _NoTE(types.ModuleType):
    """Stands in for `transformer_engine` inside bridge's LoRA module only: attributes are more
    placeholders (lower case) or classes nothing is an instance of (upper case)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():

            def unavailable(*_a, **_k):
                raise ImportError(f"{self.__name__}.{name} needs TransformerEngine, which is not installed")

            value: Any = type(name, (), {"__module__": self.__name__, "__init__": unavailable})
        else:
            value = _NoTE(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _import_answering_te(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and (name == "transformer_engine" or name.startswith("transformer_engine.")):
        top = _NoTE("transformer_engine")
        return top
    return builtins.__import__(name, globals, locals, fromlist, level)


class _LoraLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.machinery.SourceFileLoader):
        self.real = real

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__builtins__ = {**builtins.__dict__, "__import__": _import_answering_te}
        exec(self.real.get_code(module.__name__), module.__dict__)


class _LoraFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _LORA:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = _LoraLoader(spec.loader)
        return spec


def _warnings_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def import_bridge(kernels: bool = True) -> types.ModuleType:
    """`import megatron.bridge`, with or without TransformerEngine. `kernels` False: in a process
    that only builds configs and ends (the preflight's own, a CLI `--check`), without torch's
    compiler (`torch_compile_left_off`)."""
    if not te_installed() and not any(isinstance(f, _LoraFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LoraFinder())
    # bridge logs every optional import it misses (TE's FP8 classes) with a traceback, at INFO, and
    # sets that logger's level itself when imported: a filter outlasts that
    noisy = logging.getLogger("megatron.bridge.utils.import_utils")
    if _warnings_only not in noisy.filters:
        noisy.addFilter(_warnings_only)
    from ..rank.warmup import collector_paused

    left_off = contextlib.nullcontext() if kernels else torch_compile_left_off()
    with collector_paused(), distributions_listed_once(), left_off:
        import megatron.bridge

    return megatron.bridge


@contextlib.contextmanager
def distributions_listed_once():
    """transformers and diffusers (which nvidia-modelopt imports where it is installed) each call
    `importlib.metadata.packages_distributions()` as they are imported: it reads the file list of
    every installed distribution and looks at each file on it (44,641 in the test venv), about a
    CPU-second each time on a 2-core machine. While this lasts, the second call gets a copy of the
    first's answer; after it, the function is the standard library's again."""
    real = importlib.metadata.packages_distributions
    first = functools.cache(real)
    importlib.metadata.packages_distributions = lambda: {k: list(v) for k, v in first().items()}
    try:
        yield
    finally:
        importlib.metadata.packages_distributions = real


def _not_compiled(model: Any = None, **options: Any) -> Any:
    """`torch.compile` as a decorator that leaves the function as it is (with or without options)."""
    return model if model is not None else (lambda fn: fn)


@contextlib.contextmanager
def torch_compile_left_off():
    """megatron-core's `jit_fuser` is `torch.compile`, which it applies at import to its fused kernels
    (bias-GeLU, SwiGLU, ...): that imports torch's dynamo and inductor, 1.5 of megatron-core's 3.0
    CPU-s of import on a 2-core machine (1 of bridge's 13). While this lasts, `torch.compile`
    leaves functions as they are; only for a process that never runs those kernels, and that imports
    megatron-core in here first: the dry run's rank (its config turns every fusion off), the
    preflight's process and a CLI `--check` (they build a config and end: `import_bridge`)."""
    import torch

    compile_ = torch.compile
    torch.compile = _not_compiled
    try:
        yield
    finally:
        torch.compile = compile_


@contextlib.contextmanager
def not_installed(names: tuple[str, ...]) -> Iterator[None]:
    """While this lasts, `import <name>` fails as it does where the package is not installed
    (ModuleNotFoundError), for each of `names` not imported already; afterwards it imports again.
    For optional packages that megatron-core tries at import and goes on without, only where nothing
    in the process will use them (the dry run's rank: tiny_gpt.py `DRY_RUN_NOT_INSTALLED`)."""
    left_out = [name for name in names if name not in sys.modules]
    for name in left_out:
        sys.modules[name] = None  # type: ignore[assignment]  # Python's own "not importable" mark
    try:
        yield
    finally:
        for name in left_out:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def adapt_model_without_te(model: Any) -> list[str]:
    """Local layer spec and no kernel fusions when TE is absent, or when the recipe asks for the
    local implementation (`model.transformer_impl=local`); returns what was changed."""
    if te_installed() and getattr(model, "transformer_impl", None) != "local":
        return []
    from megatron.bridge.models.gpt_provider import local_layer_spec

    changed = []
    if getattr(model, "transformer_layer_spec", None) is not local_layer_spec:
        model.transformer_layer_spec = local_layer_spec
        changed.append("transformer_layer_spec=local")
    if hasattr(model, "transformer_impl") and model.transformer_impl != "local":
        model.transformer_impl = "local"
        changed.append("transformer_impl=local")
    for name in FUSIONS_NEEDING_KERNELS:
        if getattr(model, name, False):
            setattr(model, name, False)
            changed.append(f"{name}=False")
    return changed


def adapt_optimizer_without_te(optimizer: Any) -> list[str]:
    """The precision-aware optimizer is TE's FusedAdam: where TE is absent, Megatron's own Adam (as
    bridge's own H100 Llama recipes set it) instead of a RuntimeError at the first step of every rank."""
    if te_installed() or not getattr(optimizer, "use_precision_aware_optimizer", False):
        return []
    optimizer.use_precision_aware_optimizer = False
    return ["optimizer.use_precision_aware_optimizer=False"]


def skip_compile_helpers_if_prebuilt() -> bool:
    """Stop bridge from running `make` for helpers the wheel already ships. True if patched."""
    import megatron.core.datasets as datasets

    if (Path(datasets.__file__).parent / "Makefile").exists():
        return False  # a source checkout: let it build
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False  # nothing prebuilt: let megatron report it
    import megatron.bridge.training.initialize as initialize

    initialize.compile_helpers = lambda: None
    return True
