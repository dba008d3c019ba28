"""The driver's view of training progress: iteration of total, loss, tokens/s, TFLOP/s per GPU, MFU,
ETA, as a bar on a terminal or a plain line every few seconds.

Progress comes from the ranks two ways: Megatron's own iteration log line (bridge prints it on the
last pipeline stage), parsed wherever it appears in rank output, or `report()` called from a rank
of any program.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from typing import Any

from ...core.goodput import GoodputTrack
from ...core.lifecycle import LaunchObserver, LaunchState, Restart, RestartKind
from ...core.outbatch import STDERR
from ...core.progress import TrainingFacts, duration, tflops_per_gpu

log = logging.getLogger("megaray")


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


class ProgressView(LaunchObserver):
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
        self.restarts = 0
        self.goodput = GoodputTrack()  # where the launch's time went (core/goodput.py)

    @property
    def first_at(self) -> float | None:
        """When a rank reported the first iteration (time to first step)."""
        return self.goodput.first_at

    def on_state(self, state: LaunchState) -> None:
        """Told by the controller: a relaunch starts its own timing (iterations resume from the last
        checkpoint, after the time the restart took), and the line says which relaunch it is."""
        if state is LaunchState.RESTARTING:
            self.restarts += 1
            self.last = None
            self.goodput.relaunched()

    def on_restart(self, restart: Restart) -> None:
        if restart.kind is RestartKind.FAILURE:  # the time between failures (core/goodput.py `advice`)
            self.goodput.failures += 1

    def update(self, record: dict[str, Any]) -> None:
        """A rank's progress; the same iteration again (another rank's report of it) changes nothing."""
        if self.last is not None and record["iteration"] <= self.last["iteration"]:
            return
        previous, self.last = self.last, record
        it = record["iteration"]
        self.goodput.iteration(record["time"], it)
        total = record.get("total") or self.facts.train_iters
        iter_s = record.get("iter_s")
        if iter_s is None and previous and it > previous["iteration"]:
            iter_s = (record["time"] - previous["time"]) / (it - previous["iteration"])
        tokens = record.get("tokens")
        if tokens is None and self.facts.seq_length:
            batch = record.get("global_batch") or self.facts.global_batch
            tokens = batch * self.facts.seq_length if batch else None
        s: dict[str, Any] = {
            "iteration": it,
            "total": total,
            "loss": record.get("loss"),
            "at": record["time"],
        }
        if iter_s:
            s["iter_s"] = iter_s
            flops = record.get("flops")  # one iteration's, every rank together (report(flops=...))
            if tokens:
                s["tokens_per_s"] = tokens / iter_s
                if self.facts.flops_per_token and not flops:
                    flops = self.facts.flops_per_token * tokens
            if flops:
                tflops = tflops_per_gpu(flops, iter_s, self.world_size)
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
            parts.append(f"ETA {duration(s['eta_s'])}")
        if self.restarts:
            parts.append(f"restart {self.restarts}")
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

    def print_lines(self, lines: list[tuple[int, str]]) -> None:
        """Rank output, each line on the stream it was written to (a rank's stderr on stderr, as
        torchrun has it), above the bar when there is one."""
        if not lines:
            return
        if self.bar is not None:
            from tqdm import tqdm

            for stream, ln in lines:
                tqdm.write(ln, file=sys.stderr if stream == STDERR else sys.stdout)
            return
        for is_err, run in itertools.groupby(lines, key=lambda x: x[0] == STDERR):
            out = sys.stderr if is_err else sys.stdout
            out.write("".join(ln + "\n" for _, ln in run))
            out.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.stats and self.stats.get("iteration") != self.printed_iteration:
            log.info("progress: %s", self.describe())
