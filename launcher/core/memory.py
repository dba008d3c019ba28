"""Memory a GPU needs at the first training step: what Megatron-Bridge's own estimator leaves out.

Bridge's estimator (`theoretical_memory_utils.estimate_training_memory`, used by
launcher/megatron/memory.py) assumes flash attention or selective recompute, Adam on every
parameter, and reads the data-parallel size from a config that has not been validated yet. These
pure functions add what a launch on a real layout changes, in bytes, with the reason for each.
Activation terms follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2), 16-bit activations.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory at the first step on the most-loaded GPU, in bytes."""

    model_state: float  # weights, gradients and optimizer states
    activations: float
    parameters: float  # the whole model's
    notes: tuple[str, ...] = ()  # what was corrected, and why

    @property
    def total(self) -> float:
        return self.model_state + self.activations

    def describe(self) -> str:
        return (
            f"{self.total / GIB:.1f} GiB per GPU at the first step (weights, gradients and optimizer "
            f"{self.model_state / GIB:.1f} GiB, activations {self.activations / GIB:.1f} GiB; "
            f"{self.parameters / 1e9:.2f}B parameters)"
        )


def attention_scores_bytes(
    seq: int, micro: int, heads: int, layers: int, tp: int, cp: int, pp: int, num_microbatches: int
) -> float:
    """What unfused attention (no flash kernel: megatron-core's local layer spec) keeps per layer for
    the backward pass beyond bridge's formula: the score matrices, softmax output and dropout mask,
    5·a·s²·b bytes, split over TP (heads) and CP (queries); the first pipeline stage holds every
    layer's worth across the micro-batches in flight, as bridge counts its own terms."""
    in_flight = 1.0 if pp == 1 else min(1.0, num_microbatches / pp)
    return 5 * heads * seq * seq * micro * layers * in_flight / (tp * cp)


def full_recompute_saving(
    seq: int, micro: int, hidden: int, layers: int, ffn_ratio: float, tp: int, cp: int
) -> float:
    """What full recompute saves against bridge's formula: each layer keeps only its input (2·s·b·h
    bytes) instead of its activations (s·b·h·(18 + 4·ffn_ratio)), but for the one being recomputed."""
    per_layer = seq * micro * hidden * (18 + 4 * ffn_ratio) / (tp * cp)
    kept_input = 2 * seq * micro * hidden / (tp * cp)
    return max(0.0, (layers - 1) * per_layer - layers * kept_input)


def frozen_model_state(parameters_per_gpu: float, bytes_per_weight: float = 2.0) -> float:
    """PEFT (LoRA, DoRA) trains adapters only: the base weights need no gradients nor optimizer
    states, only themselves (16-bit); the adapters are a fraction of a percent."""
    return parameters_per_gpu * bytes_per_weight


# what makes a first step smaller, where no single override tried on the config was found to fit
GENERAL_REMEDIES = "more nodes with more TP/PP, recompute, a smaller micro-batch or the distributed optimizer"


def fit_problem(estimate: MemoryEstimate, gpu_gib: float) -> str | None:
    """Why the estimate does not fit a GPU of `gpu_gib`, or None."""
    if estimate.total <= gpu_gib * GIB:
        return None
    return f"needs {estimate.describe()}, more than the {gpu_gib:g} GiB of one GPU"
