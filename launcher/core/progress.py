"""Training progress as data: Megatron's iteration log line parsed, and what the driver knows of the
training from the config the preflight built (the display is driver/output/progress_view.py, the rank-side
`report()` rank/capture.py, FLOPs per token megatron/facts.py)."""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# Dense BF16 peak of an H100 SXM (NVIDIA's datasheet gives 1,979 with sparsity): the MFU denominator
# unless --peak-tflops says otherwise.
H100_SXM_BF16_TFLOPS = 989.0


def tflops_per_gpu(flops: float, seconds: float, gpus: int) -> float:
    """TFLOP/s of each GPU: one step's FLOPs, every rank together, over its time and the GPUs."""
    return flops / seconds / gpus / 1e12


_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_ELAPSED_MS = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")
_GLOBAL_BATCH = re.compile(r"global batch size:\s*(\d+)")
_LOSS = re.compile(r"\|\s*(lm loss|loss):\s*([-+0-9.eEnaif]+)\s*\|")


class Phase(StrEnum):
    """Where a checkpoint is, as the ranks' lines (or `launcher.checkpointing`) say."""

    SAVING = "saving"
    SAVED = "saved"
    LOADING = "loading"
    LOADED = "loaded"


# Megatron-Bridge's lines on rank 0 (training/checkpointing.py), the dry-run trainer's the same way:
# `saving checkpoint at iteration N to DIR`, then `successfully saved checkpoint from iteration N to DIR`
# once every rank saved (the dry run: `saved checkpoint at iteration N to DIR`); `loading checkpoint
# from DIR at iteration N` (bridge: `loading distributed checkpoint ...`), then `successfully loaded
# checkpoint from DIR [...] at iteration N` (the dry run: `resumed from checkpoint at iteration N`)
_CHECKPOINT = (
    (
        Phase.SAVED,
        re.compile(r"\b(?:successfully saved checkpoint from|saved checkpoint at) iteration\s+(\d+) to "),
    ),
    (Phase.SAVING, re.compile(r"\bsaving checkpoint at iteration\s+(\d+) to ")),
    (
        Phase.LOADED,
        re.compile(
            r"\b(?:successfully loaded checkpoint from .* at|resumed from checkpoint at) iteration\s+(\d+)"
        ),
    ),
    (Phase.LOADING, re.compile(r"\bloading (?:distributed )?checkpoint from .* at iteration\s+(\d+)")),
)


def parse_megatron_line(line: str) -> dict[str, Any] | None:
    """Megatron's `iteration N/ M | ... | elapsed time per iteration (ms): T | ... | lm loss: L |`."""
    it = _ITERATION.search(line)
    if it is None or "elapsed time per iteration" not in line:
        return None
    record: dict[str, Any] = {"iteration": int(it.group(1)), "total": int(it.group(2)), "time": time.time()}
    if m := _ELAPSED_MS.search(line):
        record["iter_s"] = float(m.group(1)) / 1000.0
    if m := _GLOBAL_BATCH.search(line):
        record["global_batch"] = int(m.group(1))
    if m := _LOSS.search(line):
        with contextlib.suppress(ValueError):
            record["loss"] = float(m.group(2))
    return record


def duration(seconds: float, tenths: bool = False) -> str:
    """`1h02m`, `4m10s`, `7s` (`tenths`: `7.2s` under a minute), for the progress line and goodput."""
    if tenths and seconds < 59.95:
        return f"{seconds:.1f}s"
    s = int(seconds + 0.5)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def parse_checkpoint_line(line: str) -> tuple[Phase, int] | None:
    """What the line says of a checkpoint (saving, saved, loading, loaded) and its iteration, or None."""
    if "checkpoint" not in line:
        return None
    for phase, pattern in _CHECKPOINT:
        if m := pattern.search(line):
            return phase, int(m.group(1))
    return None


@dataclass(frozen=True)
class TrainingFacts:
    """What the driver knows about the training from the config the preflight built."""

    seq_length: int | None = None
    global_batch: int | None = None
    train_iters: int | None = None
    flops_per_token: float | None = None
