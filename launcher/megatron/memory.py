"""The memory preflight: Megatron-Bridge's own estimate for the resolved config on the launch's
layout, corrected where it is silent or wrong for it (core/memory.py), and what would make a layout
that does not fit fit, tried on copies of the config."""

from __future__ import annotations

import copy
from typing import Any

from ..core.memory import (
    GENERAL_REMEDIES,
    MemoryEstimate,
    attention_scores_bytes,
    fit_problem,
    frozen_model_state,
    full_recompute_saving,
)
from .facts import as_finalized


def _layout(cfg: Any) -> dict[str, int]:
    m = cfg.model
    return {k: int(getattr(m, f, None) or 1) for k, f in (
        ("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
        ("cp", "context_parallel_size"),
    )}  # fmt: skip


def _prepared(cfg: Any, world_size: int) -> tuple[Any, int]:
    """A copy of `cfg` as bridge sees it once training starts: the data-parallel size of this launch
    (bridge's estimator reads 1 before validation) and the distributed optimizer on in both places
    when either asks for it (bridge syncs them at validation). Returns it and the micro-batch count."""
    out = as_finalized(cfg)
    lay = _layout(out)
    dp = max(1, world_size // (lay["tp"] * lay["pp"] * lay["cp"]))
    out.data_parallel_size = dp
    distributed = bool(
        getattr(out.ddp, "use_distributed_optimizer", False)
        or getattr(out.optimizer, "use_distributed_optimizer", False)
    )
    out.optimizer = copy.copy(out.optimizer)
    out.optimizer.use_distributed_optimizer = distributed
    micro = int(out.train.micro_batch_size)
    return out, max(1, int(out.train.global_batch_size) // (micro * dp))


def _ffn_ratio(m: Any) -> float:
    ffn = getattr(m, "ffn_hidden_size", None) or 4 * m.hidden_size
    if getattr(m, "num_moe_experts", None):
        topk = getattr(m, "moe_router_topk", None) or 1
        ffn = (getattr(m, "moe_ffn_hidden_size", None) or ffn) * topk
    return ffn / m.hidden_size


def estimate(cfg: Any, world_size: int, te_adapted: bool = False) -> MemoryEstimate:
    """`te_adapted`: the recipe asked for TransformerEngine and this machine has none, so the config
    was switched to the local spec here; the ranks are expected to have TE (recipes are written for
    it) and are estimated with its fused attention, the unfused cost said in a note."""
    from megatron.bridge.training.utils.theoretical_memory_utils import estimate_training_memory

    prepared, microbatches = _prepared(cfg, world_size)
    est = estimate_training_memory(prepared, microbatches)
    m, lay = prepared.model, _layout(prepared)
    seq, micro, layers = int(m.seq_length), int(prepared.train.micro_batch_size), int(m.num_layers)
    model_state = sum(c.memory_bytes for c in est.model_state_components)
    activations = est.activation.memory_bytes if est.activation is not None else 0.0
    notes = [f"Megatron-Bridge's estimate on this layout (DP {prepared.data_parallel_size})"]
    if getattr(prepared, "peft", None) is not None:
        per_gpu = sum(c.parameter_count_per_gpu for c in est.model_state_components)
        model_state = frozen_model_state(per_gpu)
        notes.append("PEFT: the base weights are frozen (no gradients or optimizer states for them)")
    recompute = getattr(m, "recompute_granularity", None)
    if recompute == "full":
        activations -= full_recompute_saving(
            seq, micro, m.hidden_size, layers, _ffn_ratio(m), lay["tp"], lay["cp"]
        )
        notes.append("full recompute: each layer keeps its input only")
    unfused = getattr(m, "transformer_impl", None) == "local" or str(
        getattr(m, "attention_backend", "")
    ).endswith(("unfused", "local"))
    if unfused and recompute != "selective":
        scores = attention_scores_bytes(
            seq, micro, m.num_attention_heads, layers, lay["tp"], lay["cp"], lay["pp"], microbatches
        )
        if te_adapted:
            notes.append(
                f"estimated with TransformerEngine's fused attention, as the recipe asks; ranks without TE "
                f"run unfused attention, which keeps its s x s scores: {scores / 2**30:.1f} GiB more"
            )
        else:
            activations += scores
            notes.append("attention without a fused kernel (local layer spec) keeps its s x s scores")
    return MemoryEstimate(model_state, max(0.0, activations), est.total_parameters, tuple(notes))


def remedies(cfg: Any, world_size: int, gpu_gib: float, te_adapted: bool = False) -> list[str]:
    """Overrides that each, alone, would bring the estimate under `gpu_gib`, with what they give."""
    m, lay = cfg.model, _layout(cfg)
    tries: list[tuple[str, str, Any]] = []
    if not (
        getattr(cfg.ddp, "use_distributed_optimizer", False)
        or getattr(cfg.optimizer, "use_distributed_optimizer", False)
    ):
        tries.append(("ddp.use_distributed_optimizer=true", "ddp", ("use_distributed_optimizer", True)))
    tries.append(
        (
            f"model.tensor_model_parallel_size={lay['tp'] * 2}",
            "model",
            ("tensor_model_parallel_size", lay["tp"] * 2),
        )
    )
    if m.num_layers % (lay["pp"] * 2) == 0:
        tries.append(
            (
                f"model.pipeline_model_parallel_size={lay['pp'] * 2}",
                "model",
                ("pipeline_model_parallel_size", lay["pp"] * 2),
            )
        )
    if getattr(m, "recompute_granularity", None) != "selective":
        tries.append(
            ("model.recompute_granularity=selective", "model", ("recompute_granularity", "selective"))
        )
    if getattr(m, "recompute_granularity", None) != "full":
        full = "model.recompute_granularity=full model.recompute_method=uniform model.recompute_num_layers=1"
        tries.append((full, "model", ("recompute_granularity", "full")))
    if int(cfg.train.micro_batch_size) > 1:
        tries.append((f"train.micro_batch_size={int(cfg.train.micro_batch_size) // 2}", "train",
                      ("micro_batch_size", int(cfg.train.micro_batch_size) // 2)))  # fmt: skip
    out = []
    for text, section, (attr, value) in tries:
        variant = copy.copy(cfg)
        part = copy.copy(getattr(cfg, section))
        setattr(part, attr, value)
        setattr(variant, section, part)
        try:
            total = estimate(variant, world_size, te_adapted).total
        except Exception:  # a combination the estimator cannot take: not a suggestion then
            continue
        if total <= gpu_gib * 2**30:
            out.append(f"{text} ({total / 2**30:.1f} GiB)")
    return out


def check(
    cfg: Any, world_size: int, gpu_gib: float, te_adapted: bool = False
) -> tuple[MemoryEstimate, str | None]:
    """The estimate, and why it does not fit with what would fix it (None when it fits)."""
    est = estimate(cfg, world_size, te_adapted)
    problem = fit_problem(est, gpu_gib)
    if problem is None:
        return est, None
    fixes = remedies(cfg, world_size, gpu_gib, te_adapted)
    how = "each of these alone would fit: " + "; ".join(fixes) if fixes else GENERAL_REMEDIES
    return est, f"{problem}; {how} (or give the GPU's size with --gpu-memory-gb)"
