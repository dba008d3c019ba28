"""Preflight: build the Megatron config on CPU and check its layout and memory before training starts.

A launch runs it in a process of its own, beside connecting and starting the ranks
(megatron/preflight_process.py); `--check` runs it here. A layout that does not fit exits 2 with
nothing left running. It needs megatron-bridge where the driver runs; without it the launch goes on
and the ranks find out themselves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..core.errors import UsageError
from ..core.layout import Layout, layout_problems
from ..core.memory import GENERAL_REMEDIES, MemoryEstimate, fit_problem
from ..core.progress import TrainingFacts
from ..core.spec import DEFAULT_GPU_MEMORY_GB, LaunchSpec
from .facts import facts_from_config

log = logging.getLogger("megaray")


@dataclass(frozen=True)
class Plan:
    """What the preflight learned, as plain values (it crosses from the preflight's process to the
    driver, which never imports Megatron): the layout, the resolved config as bridge writes it (for
    the run directory), the facts progress reporting needs (sequence length, batch, iterations, FLOPs
    per token), and what a relaunch and the hang timeout read of the config."""

    layout: Layout | None
    config_yaml: str
    facts: TrainingFacts
    timeout_minutes: int  # dist.distributed_timeout_minutes
    checkpoint_save: str | None
    checkpoint_load: str | None
    # the first step's memory per GPU, to check against the placed GPUs' (unless --gpu-memory-gb)
    memory: MemoryEstimate | None = None

    @classmethod
    def of(cls, layout: Layout | None, cfg: Any, memory: MemoryEstimate | None = None) -> Plan:
        ckpt = cfg.checkpoint
        return cls(
            layout, config_yaml(cfg), facts_from_config(cfg), int(cfg.dist.distributed_timeout_minutes),
            str(ckpt.save) if ckpt.save else None, str(ckpt.load) if ckpt.load else None, memory,
        )  # fmt: skip

    def memory_problem(self, recipe: str, gpu_gib: float) -> str | None:
        """Why the first step does not fit GPUs of `gpu_gib` (the placed ones'), or None."""
        if self.memory is None or (problem := fit_problem(self.memory, gpu_gib)) is None:
            return None
        return (
            f"recipe {recipe}: {problem} (the smallest GPU placed, from NVML); {GENERAL_REMEDIES} would "
            f"fit (`--check --gpu-memory-gb {gpu_gib:g}` lists which), or give another size with "
            "--gpu-memory-gb"
        )


def config_yaml(cfg: Any) -> str:
    """The config as bridge's own `to_yaml` writes it (the representers it needs are bridge's)."""
    fd, path = tempfile.mkstemp(prefix="megaray-config-", suffix=".yaml")
    os.close(fd)
    try:
        cfg.to_yaml(path)
        with open(path) as f:
            return f.read()
    finally:
        os.unlink(path)


@contextlib.contextmanager
def quiet_megatron() -> Iterator[None]:
    """Megatron-core and bridge warn, as they import and build, about what this machine lacks
    (TransformerEngine, Apex, a CUDA runtime, a process group): about 30 lines before the preflight's
    own, and about the driver's machine, not the ranks' (which print theirs in their logs). What
    matters for the launch is said in the preflight's notes (`no TransformerEngine here: ...`)."""
    loggers = [logging.getLogger(name) for name in ("megatron", "torch.utils.cpp_extension")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


@contextlib.contextmanager
def no_gpu_visible() -> Iterator[None]:
    """The preflight builds and estimates on CPU. With no GPU visible, importing bridge (whose
    nvidia-modelopt asks the device's compute capability at import) makes no CUDA context on a GPU of
    the node the driver runs on, which a rank of the launch may be about to use; CUDA reads the
    variable once, when first used, so it is set only around the preflight."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def preflight(spec: LaunchSpec, hide_gpus: bool = True, kernels: bool = True) -> Plan | None:
    """`hide_gpus` False: in rank 0's own process (preflight_process.py `answer`), whose CUDA must
    see its GPU when it first loads (the only context the preflight could make there is on it).
    `kernels` False: in a process that ends once it has answered (compat.py `import_bridge`)."""
    with quiet_megatron(), no_gpu_visible() if hide_gpus else contextlib.nullcontext():
        return _preflight(spec, kernels)


def _preflight(spec: LaunchSpec, kernels: bool) -> Plan | None:
    target = spec.target
    if target.recipe is None:
        return None
    t0 = time.monotonic()
    try:
        from .bridge_target import build_config, copy_prebuilt

        args = (target.recipe, list(target.args), target.hf_path)
        # a config built ahead is there in rank 0's process
        cfg, notes = copy_prebuilt(*args) or build_config(*args, kernels)
    except ModuleNotFoundError as e:
        if spec.check_only:
            raise UsageError(
                f"--check needs megatron-bridge in the driver ({e}); install megaray[megatron]"
            ) from None
        log.warning(
            "preflight skipped: %s in the driver (install megaray[megatron] to check layouts here)", e
        )
        return None
    layout = Layout.from_config(cfg)
    wanted = spec.node_range  # --nodes MIN:MAX: a launch runs on the counts the layout fits
    counts = range(wanted.max, wanted.min - 1, -1)
    fits = [n for n in counts if not layout_problems(layout, n, spec.gpus_per_node)]
    if not fits:
        problems = layout_problems(layout, spec.nodes, spec.gpus_per_node)
        raise UsageError(
            f"recipe {target.recipe.name}: layout {layout.describe()} does not fit: " + "; ".join(problems)
        )
    if fits[0] != spec.nodes:
        log.info("preflight: the layout fits %s of --nodes %s node(s)", ", ".join(map(str, fits)), wanted)
    dp = spec.world_size // (layout.tp * layout.pp * layout.cp)
    for note in notes:
        log.info("preflight: %s", note)
    from .bridge_target import finetune_problem, te_adapted

    if problem := finetune_problem(target.recipe, cfg):
        raise UsageError(problem)
    if missing := data_problems(cfg):
        raise UsageError(
            f"recipe {target.recipe.name}: {'; '.join(missing)} on this machine (the ranks read the same "
            "paths: put the data on a shared filesystem, or at the same path on every node)"
        )
    set_vocab_from_tokenizer(cfg)
    est = None
    if spec.uses_gpus:
        # with --nodes MIN:MAX, on the fewest nodes the layout fits: the smallest DP holds the most per GPU
        est = check_memory(spec.at_nodes(fits[-1]), cfg, te_adapted=te_adapted(notes))
    log.info(
        "preflight: %s, DP %d fits %d rank(s) (%.1f s)",
        layout.describe(),
        dp,
        spec.world_size,
        time.monotonic() - t0,
    )
    return Plan.of(layout, cfg, est)


def data_problems(cfg: Any) -> list[str]:
    from ..core.dataset_paths import blend_prefixes, missing_data

    d, t = cfg.dataset, cfg.tokenizer
    prefixes = blend_prefixes(getattr(d, "blend", None))
    for split in getattr(d, "blend_per_split", None) or ():
        prefixes += blend_prefixes(split)
    files = [(f"tokenizer.{k}", getattr(t, k, None)) for k in ("tokenizer_model", "vocab_file", "merge_file")]
    return missing_data(prefixes, getattr(d, "dataset_root", None), [(k, str(v)) for k, v in files if v])


def set_vocab_from_tokenizer(cfg: Any) -> None:
    """A model whose vocab size comes from its tokenizer (`model.vocab_size: null`) gets it as bridge's
    pretrain() will give it, so that the memory estimate and the FLOPs have it; only for a tokenizer
    on this machine, which loads in a moment (a hub id could mean a download)."""
    from ..core.dataset_paths import is_local_path

    model, tok = cfg.model, cfg.tokenizer
    local = str(getattr(tok, "tokenizer_model", None) or "")
    if model.vocab_size is not None or not is_local_path(local):
        return
    from megatron.bridge.training.setup import _validate_and_set_vocab_size
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    try:
        tokenizer = build_tokenizer(tok)
        model.vocab_size, model.should_pad_vocab = _validate_and_set_vocab_size(
            model_vocab_size=None, tokenizer_vocab_size=tokenizer.vocab_size,
            use_tokenizer_vocab_size=getattr(tok, "use_tokenizer_vocab_size", False),
        )  # fmt: skip
    except Exception as e:  # the ranks will fail on it with bridge's own message; the estimate goes without
        log.warning("preflight: could not load the tokenizer %s (%s)", local, str(e).splitlines()[0][:200])


def check_memory(spec: LaunchSpec, cfg: Any, te_adapted: bool) -> MemoryEstimate | None:
    """Exit 2 before training when the first step would not fit the GPU's memory: --gpu-memory-gb
    when given, else (a launch) the placed GPUs' own, checked once they report it
    (`Plan.memory_problem`), and for `--check`, which places nothing, DEFAULT_GPU_MEMORY_GB."""
    from . import memory

    gib = spec.gpu_memory_gb or (DEFAULT_GPU_MEMORY_GB if spec.check_only else None)
    try:
        if gib is None:
            est, problem = memory.estimate(cfg, spec.world_size, te_adapted), None
        else:
            est, problem = memory.check(cfg, spec.world_size, gib, te_adapted)
    except Exception as e:  # a model bridge's estimator does not cover: say so, and go on
        log.warning("preflight: no memory estimate for this model (%s)", " ".join(str(e).split())[:200])
        return None
    if problem:
        raise UsageError(f"recipe {spec.target.recipe.name}: {problem}")
    of = f"of {gib:g} GiB" if gib is not None else "to check against the GPUs placed"
    log.info("preflight: memory %s, %s", est.describe(), of)
    for note in est.notes[1:]:
        log.info("preflight: memory: %s", note)
    return est
