"""What the driver's progress view needs from a Megatron-Bridge config: tokens per iteration and FLOPs
per token, from bridge's `num_floating_point_operations`, the formula bridge logs its own TFLOP/s with."""

from __future__ import annotations

import copy
import logging
from typing import Any

from ..core.progress import TrainingFacts

log = logging.getLogger("megaray")


def as_finalized(cfg: Any) -> Any:
    """A copy of `cfg` with the model fields bridge fills in only when training starts (from the
    attention heads and the tokenizer), which its FLOPs formula needs."""
    m = copy.copy(cfg.model)
    if getattr(m, "kv_channels", 0) is None:
        m.kv_channels = m.hidden_size // m.num_attention_heads
    if getattr(m, "num_query_groups", 0) is None:
        m.num_query_groups = m.num_attention_heads
    if getattr(m, "vocab_size", 0) is None:
        m.vocab_size = getattr(cfg.tokenizer, "vocab_size", None)
    out = copy.copy(cfg)
    out.model = m
    return out


def flops_per_token(cfg: Any) -> float | None:
    """Megatron-Bridge's FLOPs for one sequence (forward and backward), per token."""
    try:
        from megatron.bridge.training.utils.flop_utils import num_floating_point_operations

        return float(num_floating_point_operations(as_finalized(cfg), 1)) / cfg.model.seq_length
    except Exception as e:  # a model family the formula does not cover: show progress without it
        log.info("no FLOPs formula for this model (%s): TFLOP/s and MFU not shown", str(e).splitlines()[0])
        return None


def facts_from_config(cfg: Any) -> TrainingFacts:
    return TrainingFacts(
        seq_length=cfg.model.seq_length,
        global_batch=cfg.train.global_batch_size,
        train_iters=cfg.train.train_iters,
        flops_per_token=flops_per_token(cfg),
    )
