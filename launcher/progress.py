"""Training progress in the driver: iteration of total, loss, tokens/s, TFLOP/s per GPU, MFU, ETA.

Progress comes from the ranks two ways: Megatron's own iteration log line (bridge prints it on the
last pipeline stage), parsed wherever it appears in rank output, or `report()` called from a rank
of any program. FLOPs per token come from Megatron-Bridge's `num_floating_point_operations`, the
formula bridge logs its own TFLOP/s with, evaluated on the config the preflight built.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("megaray")

# Dense BF16 peak of an H100 SXM (NVIDIA's datasheet gives 1,979 with sparsity): the MFU denominator
# unless --peak-tflops says otherwise.
H100_SXM_BF16_TFLOPS = 989.0

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_ELAPSED_MS = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")
_GLOBAL_BATCH = re.compile(r"global batch size:\s*(\d+)")
_LOSS = re.compile(r"\|\s*(lm loss|loss):\s*([-+0-9.eEnaif]+)\s*\|")


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


def report(iteration: int, total: int | None = None, loss: float | None = None, tokens: int | None = None):
    """Tell the driver how training goes, from a rank (usually the one that has the loss).

    `tokens` is what one iteration processes across all ranks (global batch x sequence length).
    Outside a megaray launch this does nothing, so programs can call it unconditionally.
    """
    from .output import current_sink

    sink = current_sink()
    if sink is None:
        return  # not a megaray rank (torchrun, or a plain process)
    record = {"iteration": int(iteration), "time": time.time()}
    for key, value in (("total", total), ("loss", loss), ("tokens", tokens)):
        if value is not None:
            record[key] = value
    sink.report.remote(int(os.environ.get("RANK", "0")), record)


@dataclass(frozen=True)
class TrainingFacts:
    """What the driver knows about the training from the config the preflight built."""

    seq_length: int | None = None
    global_batch: int | None = None
    train_iters: int | None = None
    flops_per_token: float | None = None


def flops_per_token(cfg: Any) -> float | None:
    """Megatron-Bridge's FLOPs for one sequence (forward and backward), per token."""
    try:
        from megatron.bridge.training.utils.flop_utils import num_floating_point_operations

        return float(num_floating_point_operations(cfg, 1)) / cfg.model.seq_length
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


def _duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


class ProgressView:
    """Turns progress records into a bar on a terminal, or a plain line every few seconds."""

    PLAIN_EVERY_S = 5.0

    def __init__(self, facts: TrainingFacts, world_size: int, peak_tflops: float, tty: bool | None = None):
        self.facts = facts
        self.world_size = world_size
        self.peak = peak_tflops
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.bar: Any = None
        self.last: dict[str, Any] | None = None
        self.last_printed = 0.0
        self.printed_iteration: int | None = None
        self.stats: dict[str, Any] = {}

    def update(self, record: dict[str, Any]) -> None:
        previous, self.last = self.last, record
        it = record["iteration"]
        total = record.get("total") or self.facts.train_iters
        iter_s = record.get("iter_s")
        if iter_s is None and previous and it > previous["iteration"]:
            iter_s = (record["time"] - previous["time"]) / (it - previous["iteration"])
        tokens = record.get("tokens")
        if tokens is None and self.facts.seq_length:
            batch = record.get("global_batch") or self.facts.global_batch
            tokens = batch * self.facts.seq_length if batch else None
        s: dict[str, Any] = {"iteration": it, "total": total, "loss": record.get("loss")}
        if iter_s:
            s["iter_s"] = iter_s
            if tokens:
                s["tokens_per_s"] = tokens / iter_s
                if self.facts.flops_per_token:
                    tflops = self.facts.flops_per_token * s["tokens_per_s"] / self.world_size / 1e12
                    s["tflops_per_gpu"], s["mfu"] = tflops, tflops / self.peak
            if total:
                s["eta_s"] = max(0, total - it) * iter_s
        self.stats = s
        self._show(final=bool(total) and it >= total)

    def describe(self) -> str:
        s = self.stats
        parts = [f"iteration {s['iteration']}" + (f"/{s['total']}" if s.get("total") else "")]
        if s.get("loss") is not None:
            parts.append(f"loss {s['loss']:.4g}")
        if "tokens_per_s" in s:
            parts.append(f"{_si(s['tokens_per_s'])} tokens/s")
        if "tflops_per_gpu" in s:
            parts.append(
                f"{s['tflops_per_gpu']:.1f} TFLOP/s/GPU ({100 * s['mfu']:.1f}% MFU of {self.peak:g})"
            )
        if "eta_s" in s:
            parts.append(f"ETA {_duration(s['eta_s'])}")
        return " | ".join(parts)

    def _show(self, final: bool) -> None:
        if self.tty:
            self._draw()
            return
        now = time.monotonic()
        if final or not self.last_printed or now - self.last_printed >= self.PLAIN_EVERY_S:
            self.last_printed = now
            self.printed_iteration = self.stats["iteration"]
            log.info("progress: %s", self.describe())

    def _draw(self) -> None:
        from tqdm import tqdm

        s = self.stats
        if self.bar is None:
            self.bar = tqdm(
                total=s.get("total"),
                file=sys.stderr,
                dynamic_ncols=True,
                bar_format="{percentage:3.0f}% |{bar:20}| {desc}",
            )
        if s.get("total") and self.bar.total != s["total"]:
            self.bar.total = s["total"]
        self.bar.n = s["iteration"]
        self.bar.set_description_str(self.describe(), refresh=True)

    def print_lines(self, lines: list[str]) -> None:
        """Rank output, above the bar when there is one."""
        if not lines:
            return
        if self.bar is not None:
            from tqdm import tqdm

            for ln in lines:
                tqdm.write(ln, file=sys.stdout)
        else:
            sys.stdout.write("".join(ln + "\n" for ln in lines))
            sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.stats and self.stats.get("iteration") != self.printed_iteration:
            log.info("progress: %s", self.describe())
