"""Everything that touches a GPU, measured beside torchrun in the same run (run it through gpu_suite.sh).

Items, each megaray beside torchrun where both apply:
  parity    gpt_small step time and time to the first iteration; the progress view against bridge's
            own log (tokens/s, TFLOP/s/GPU); peak GPU memory
  cold      command start to iteration 1, repeated in rounds that alternate who goes first: torchrun
            beside megaray starting its own Ray, then beside megaray attached to a running Ray
  warm      the parity run again on `megaray up --warm --recipe gpt_small` (bridge imported ahead, the
            preflight's config built in the pool's process), to the first iteration beside torchrun's
  arch      a real architecture (Qwen3-8B's config at 2 layers, from the HF fixture) the same way
  restart   SIGKILL of rank 0 of a bridge run that checkpoints, --max-restarts 1: warm spares, cold,
            and torchrun --max-restarts 1, to the first iteration after resuming
  doctor    megaray doctor on this node: nvidia-smi, driver, NCCL, all-reduce bandwidth
  overhead  CPU ranks (gloo) at 8 and 16 ranks attached vs torchrun, and the control plane at 64 ranks

    python3 bench/gpu_suite.py --out DIR [--only parity,arch] [--results bench/RESULTS.md]
    python3 bench/gpu_suite.py --render A.json B.json --results bench/RESULTS.md   # merge two runs

Results go to DIR/results.json and, as a dated markdown section, DIR/section.md (appended to
--results when given). The parsing and the rendering are pure and tested on CPU (tests/test_bench.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import launch_overhead  # bench/, beside this file, as are the other bench modules the items import

from launcher.core.deaths import PF_EXITING, SIGKILL_PENDING

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
ITEMS = ("parity", "cold", "warm", "arch", "restart", "doctor", "overhead")
# the overhead item's launch modes (bench/launch_overhead.py MODES): its table compares these two; the
# others (`megaray up`, a Ray started for the run) are asked with --overhead-modes
OVERHEAD_MODES = ("torchrun", "megaray-attached")
FIXTURE_QWEN3 = REPO / "tests" / "fixtures" / "hf" / "Qwen--Qwen3-8B"

# What the runs train: Megatron logs every iteration, with its own TFLOP/s/GPU.
COMMON = ["logger.log_interval=1", "logger.log_throughput=true", "validation.eval_iters=0",
          "validation.eval_interval=100000"]  # fmt: skip
PARITY = ["train.train_iters=30", "scheduler.lr_decay_iters=30", *COMMON]
# To the first iteration only: the recipe's warm-up (4 iterations) and one more.
COLD = ["train.train_iters=5", "scheduler.lr_decay_iters=5", *COMMON]
# megaray's two ways to start cold, each timed against torchrun in rounds of its own: the Ray for
# "attached" runs throughout its rounds, and a second Ray beside the "local" runs' own would share
# Ray's default ports with them.
COLD_MODES = ("local", "attached")
ARCH = ["model.num_layers=2", "model.seq_length=4096", "dataset.seq_length=4096",
        "train.micro_batch_size=1", "train.global_batch_size=8", "train.train_iters=20",
        "scheduler.lr_warmup_iters=2", "scheduler.lr_decay_iters=20", *COMMON]  # fmt: skip
# A small GPT that checkpoints every 5 iterations: saving and loading stay short beside the restart.
RESTART_MODEL = ["model.num_layers=4", "model.hidden_size=1024", "model.ffn_hidden_size=4096",
                 "model.num_attention_heads=16", "model.seq_length=1024", "dataset.seq_length=1024",
                 "train.train_iters=1000", "scheduler.lr_decay_iters=1000",
                 "checkpoint.save_interval=5", *COMMON,
                 # megatron-core 0.19.2's distributed optimizer with torch's Adam (no TE, no Apex) cannot
                 # load its own checkpoint: DistributedOptimizer.state_dict asserts one `step` over an
                 # optimizer not yet stepped (torchrun and megaray alike); Megatron's plain optimizer can
                 "optimizer.use_distributed_optimizer=false",
                 "ddp.use_distributed_optimizer=false"]  # fmt: skip
KILL_AFTER_ITERATION = 12
# Read every module the runs import once before the first is timed, so that torchrun (run first) does
# not pay alone for a cold file cache.
# CUDA's libraries are read too (a matmul where a GPU is visible): the first timed round of two calls
# on fresh H100 machines was 45-55 s for both launchers, 20 s after it, with only the imports warmed.
WARM_UP = (
    "import torch; x = torch.ones(256, 256, device='cuda') if torch.cuda.is_available() else None; "
    "print(float((x @ x).sum()) if x is not None else 'no GPU'); "
    "from launcher.megatron import compat; compat.import_bridge(); import megatron.bridge.training.pretrain, "
    "megatron.bridge.training.gpt_step, megatron.bridge.recipes.gpt.vanilla_gpt, megatron.bridge.recipes.qwen"
)  # two checkpoints (5, 10) exist; the relaunch resumes from 10

# -- parsing Megatron-Bridge's log (pure) -----------------------------------------------------------

_STAMP = re.compile(r"^\s*([\d.]+) (.*)$")
_ITER = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|")
_FIELDS = {
    "ms": re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)"),
    "tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)"),
    "global_batch": re.compile(r"global batch size:\s*(\d+)"),
    "loss": re.compile(r"lm loss: ([\d.E+-]+)"),
}
_MEGATRON_PEAK = re.compile(r"mem-max-allocated-gigabytes: ([\d.]+)")
_THEORETICAL = re.compile(r"Theoretical memory footprints: weight and optimizer=([\d.]+) MB")
_OUR_PEAK = re.compile(r"megaray: rank (\d+) peak GPU memory: ([\d.]+) GiB allocated, ([\d.]+) GiB reserved")
_PROGRESS = re.compile(r"megaray: progress: (.*)")


def read_stamped(text: str) -> list[tuple[float, str]]:
    """Lines written by `Stamped`: seconds since the command started, then the line."""
    out = []
    for line in text.splitlines():
        if m := _STAMP.match(line):
            out.append((float(m.group(1)), m.group(2)))
    return out


def parse_run(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """Iterations (time, number, ms, loss, TFLOP/s/GPU), memory figures and megaray's progress lines
    from one run's stamped output (torchrun's, or megaray's console with `[r0 n0]` prefixes)."""
    iterations: list[dict[str, Any]] = []
    run: dict[str, Any] = {"iterations": iterations, "progress": []}
    for t, line in lines:
        if (it := _ITER.search(line)) and "elapsed time per iteration" in line:
            rec: dict[str, Any] = {"t": t, "iteration": int(it.group(1)), "total": int(it.group(2))}
            for key, pattern in _FIELDS.items():
                if m := pattern.search(line):
                    rec[key] = int(m.group(1)) if key == "global_batch" else float(m.group(1))
            iterations.append(rec)
        elif m := _MEGATRON_PEAK.search(line):
            run["megatron_peak_gb"] = max(run.get("megatron_peak_gb", 0.0), float(m.group(1)))
        elif m := _THEORETICAL.search(line):
            run["theoretical_weight_optimizer_mb"] = float(m.group(1))
        elif m := _OUR_PEAK.search(line):
            run["peak_allocated_gib"], run["peak_reserved_gib"] = float(m.group(2)), float(m.group(3))
        elif m := _PROGRESS.search(line):
            run["progress"].append(m.group(1))
    return run


def steady(run: dict[str, Any], skip: int) -> dict[str, Any]:
    """Step time after `skip` warm-up iterations, time to the first iteration, the loss curve."""
    its = run["iterations"]
    times = [r["ms"] for r in its if r["iteration"] > skip and "ms" in r]
    losses = [r["loss"] for r in its if "loss" in r]
    return {
        "steady_ms": statistics.median(times) if times else None,
        "min_ms": min(times) if times else None,
        "max_ms": max(times) if times else None,
        "n": len(times),
        "first_iteration_s": its[0]["t"] if its else None,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "losses": losses,
        "peak_allocated_gib": run.get("peak_allocated_gib"),
        "peak_reserved_gib": run.get("peak_reserved_gib"),
        "megatron_peak_gb": run.get("megatron_peak_gb"),
        "theoretical_weight_optimizer_mb": run.get("theoretical_weight_optimizer_mb"),
    }


def compare_progress(
    summary_progress: dict[str, Any], run: dict[str, Any], seq_length: int
) -> dict[str, Any]:
    """megaray's progress figures (its run summary) against bridge's log line for the same iteration:
    tokens/s from Megatron's global batch, sequence and step time; TFLOP/s/GPU as Megatron prints it."""
    it = summary_progress.get("iteration")
    line = next((r for r in run["iterations"] if r["iteration"] == it), None)
    if line is None or "ms" not in line:
        return {"iteration": it, "error": "no Megatron line for that iteration"}
    megatron_tokens = line.get("global_batch", 0) * seq_length / (line["ms"] / 1000.0)
    out: dict[str, Any] = {
        "iteration": it,
        "megaray_tokens_per_s": summary_progress.get("tokens_per_s"),
        "megatron_tokens_per_s": megatron_tokens,
        "megaray_tflops": summary_progress.get("tflops_per_gpu"),
        "megatron_tflops": line.get("tflops"),
    }
    for key in ("tokens_per_s", "tflops"):
        ours, theirs = out[f"megaray_{key}"], out[f"megatron_{key}"]
        out[f"{key}_diff"] = (ours / theirs - 1.0) if ours and theirs else None
    return out


def cold_order(round_: int) -> tuple[str, str]:
    """Who goes first in a round of the cold item: torchrun in even rounds, megaray in odd ones, so
    that neither is always the one after a teardown (file cache, GPU clocks, a Ray stopping)."""
    return ("torchrun", "megaray") if round_ % 2 == 0 else ("megaray", "torchrun")


def cold_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of one cold mode's rounds, and each round's ratio (megaray / torchrun)."""
    firsts = {who: [r[who] for r in runs if r.get(who) is not None] for who in ("torchrun", "megaray")}
    medians = {who: statistics.median(v) if v else None for who, v in firsts.items()}
    ratios = [r["megaray"] / r["torchrun"] for r in runs if r.get("megaray") and r.get("torchrun")]
    return {
        **{f"{who}_median_s": m for who, m in medians.items()},
        "ratio_of_medians": medians["megaray"] / medians["torchrun"]
        if medians["megaray"] and medians["torchrun"]
        else None,
        "round_ratios": ratios,
    }


# -- rendering (pure) -------------------------------------------------------------------------------


def _f(x: Any, fmt: str = ".1f", none: str = "n/a") -> str:
    return none if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.2f}%"


def render(results: dict[str, Any]) -> str:
    """The dated RESULTS.md section for whatever items `results` holds."""
    env = results.get("env", {})
    day = results.get("date", datetime.date.today().isoformat())
    out = [f"## GPU suite (`bench/gpu_suite.sh`), {day}", ""]
    gpu = env.get("gpu", "no GPU")
    out.append(
        f"{gpu} (driver {env.get('driver', '?')}, CUDA {env.get('cuda', '?')}), "
        f"{env.get('cores', '?')} cores; "
        f"Python {env.get('python', '?')}, torch {env.get('torch', '?')}, ray {env.get('ray', '?')}, "
        f"megatron-core {env.get('megatron-core', '?')}, megatron-bridge {env.get('megatron-bridge', '?')}, "
        f"TransformerEngine {env.get('transformer-engine') or 'not installed (local layer spec)'}. "
        "Every megaray figure is beside torchrun's from the same command."
    )
    for name in ("parity", "arch"):
        if name in results:
            out += _render_pair(name, results[name])
        if name == "parity" and "cold" in results:
            out += _render_cold(results["cold"])
        if name == "parity" and "warm" in results:
            out += _render_warm(results["warm"])
    if "restart" in results:
        out += _render_restart(results["restart"])
    if "doctor" in results:
        out += _render_doctor(results["doctor"])
    if "overhead" in results:
        out += _render_overhead(results["overhead"])
    memory = [(n, results[n]) for n in ("parity", "arch") if n in results]
    if memory or "restart" in results:
        out += _render_memory(memory, results.get("restart"))
    return "\n".join(out) + "\n"


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def _span(x: dict[str, Any]) -> str:
    return f"{_f(x.get('steady_ms'))} ms ({_f(x.get('min_ms'))}-{_f(x.get('max_ms'))})"


def _render_pair(name: str, r: dict[str, Any]) -> list[str]:
    title = {"parity": "1. Step-time parity", "arch": "2. A real architecture at reduced depth"}[name]
    t, m = r.get("torchrun", {}), r.get("megaray", {})
    ratio = m["steady_ms"] / t["steady_ms"] if t.get("steady_ms") and m.get("steady_ms") else None
    first_diff = _sub(m.get("first_iteration_s"), t.get("first_iteration_s"))
    same_losses = bool(t.get("losses")) and t.get("losses") == m.get("losses")
    rows = [
        _row("", "torchrun", "megaray", "megaray vs torchrun"),
        _row("---", "---", "---", "---"),
        _row("steady step, median (min-max)", _span(t), _span(m), f"ratio {_f(ratio, '.4f')}"),
        _row("command start to iteration 1", f"{_f(t.get('first_iteration_s'))} s",
             f"{_f(m.get('first_iteration_s'))} s", f"{_f(first_diff, '+.1f')} s"),
        _row("loss, first -> last", f"{_f(t.get('loss_first'), '.3f')} -> {_f(t.get('loss_last'), '.3f')}",
             f"{_f(m.get('loss_first'), '.3f')} -> {_f(m.get('loss_last'), '.3f')}",
             "identical per iteration" if same_losses else "differ: see the logs"),
        _row("peak GPU memory allocated", f"{_f(t.get('peak_allocated_gib'), '.2f')} GiB",
             f"{_f(m.get('peak_allocated_gib'), '.2f')} GiB", ""),
    ]  # fmt: skip
    out = ["", f"### {title}: {r.get('what', '')}", "", *rows]
    if r.get("progress"):
        p = r["progress"]
        out += [
            "",
            f"4. Progress view against bridge's own log, iteration {p.get('iteration')}: tokens/s megaray "
            f"{_f(p.get('megaray_tokens_per_s'), '.0f')} vs {_f(p.get('megatron_tokens_per_s'), '.0f')} from "
            f"Megatron's step time ({_pct(p.get('tokens_per_s_diff'))}); TFLOP/s/GPU megaray "
            f"{_f(p.get('megaray_tflops'))} vs Megatron's {_f(p.get('megatron_tflops'))} "
            f"({_pct(p.get('tflops_diff'))}).",
        ]
        if r.get("progress_line"):
            out += ["", f"megaray's last progress line: `{r['progress_line']}`"]
    if r.get("preflight"):
        out += ["", "megaray's preflight:", *(f"- {line}" for line in r["preflight"])]
    if r.get("error"):
        out += ["", f"Failed: {r['error']}"]
    return out


_COLD_TITLES = {"local": "megaray starting its own Ray", "attached": "megaray attached to a running Ray"}


def _render_cold(r: dict[str, Any]) -> list[str]:
    out = ["", f"### 1a. Cold, to the first iteration: {r.get('what', '')}", "",
           _row("", "rounds (who first)", "torchrun, median", "megaray, median", "ratio of medians",
                "each round's ratio"),
           _row("---", "---", "---", "---", "---", "---")]  # fmt: skip
    for mode in COLD_MODES:
        x = r.get(mode)
        if not x:
            continue
        runs = x.get("runs", [])
        order = ", ".join(f"{run.get('first', '?')}" for run in runs)
        out.append(
            _row(
                _COLD_TITLES[mode],
                f"{len(runs)} ({order})",
                f"{_f(x.get('torchrun_median_s'))} s",
                f"{_f(x.get('megaray_median_s'))} s",
                f"**{_f(x.get('ratio_of_medians'), '.2f')}x**",
                ", ".join(_f(v, ".2f") for v in x.get("round_ratios", [])),
            )
        )
    for mode in COLD_MODES:
        for i, run in enumerate((r.get(mode) or {}).get("runs", [])):
            if run.get("preflight"):
                out += [
                    "",
                    f"megaray's preflight, {mode}, round {i + 1}:",
                    *(f"- {line}" for line in run["preflight"]),
                ]
            if run.get("exit_codes") and any(run["exit_codes"].values()):
                out += ["", f"{mode}, round {i + 1}: exit codes {run['exit_codes']}"]
    return out + (["", f"Failed: {r['error']}"] if r.get("error") else [])


def _render_warm(r: dict[str, Any]) -> list[str]:
    m = r.get("megaray", {})
    rows = [
        _row("", "torchrun", "megaray on `up --warm --recipe`", "ratio"),
        _row("---", "---", "---", "---"),
        _row("command start to iteration 1", f"{_f(r.get('torchrun_first_iteration_s'))} s",
             f"{_f(m.get('first_iteration_s'))} s", _f(r.get("ratio"), ".2f")),
        _row("steady step, median (min-max)", "", _span(m), ""),
    ]  # fmt: skip
    out = ["", f"### 1b. On a warm recipe pool: {r.get('what', '')}", "", *rows, ""]
    out.append(
        f"`megaray up` took {_f(r.get('up_s'))} s (exit {r.get('exit_codes', {}).get('up')}); the launch "
        f"{'took the pool' if r.get('took_pool') else 'did not take the pool'} (exit "
        f"{r.get('exit_codes', {}).get('megaray')})."
    )
    out += [f"- {line}" for line in r.get("preflight", [])]
    if r.get("error"):
        out += ["", f"Failed: {r['error']}"]
    return out


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _render_restart(r: dict[str, Any]) -> list[str]:
    rows = [
        _row("", "kill to first iteration after resuming", "resumed from iteration",
             "loss at that iteration, first run -> after resuming", "notes"),
        _row("---", "---", "---", "---", "---"),
    ]  # fmt: skip
    for mode in ("warm spares", "cold", "torchrun"):
        x = r.get(mode)
        if not x:
            continue
        rows.append(
            _row(
                mode if mode == "torchrun" else f"megaray, {mode}",
                f"{_f(x.get('restart_s'), '.2f')} s",
                str(x.get("resumed_at", "n/a")),
                f"{_f(x.get('loss_before'), '.3f')} -> {_f(x.get('loss_after'), '.3f')}",
                "; ".join(filter(None, [x.get("note", ""), _victim(x)])),
            )
        )
    out = ["", f"### 3. Restart from a bridge checkpoint: {r.get('what', '')}", "", *rows]
    return out + (["", f"Failed: {r['error']}"] if r.get("error") else [])


def _victim(x: dict[str, Any]) -> str:
    return f"rank 0's process after the kill: {x['victim_exit']}" if x.get("victim_exit") else ""


def _render_doctor(r: dict[str, Any]) -> list[str]:
    return ["", "### 5. `megaray doctor` on the GPU node", "", "```", r.get("output", "").rstrip(), "```",
            "", f"Exit code {r.get('exit_code')}."]  # fmt: skip


def _render_overhead(r: dict[str, Any]) -> list[str]:
    out = ["", "### 6. Launch overhead and control plane, CPU ranks (gloo) on this node's cores", ""]
    launch = r.get("launch", {})
    if launch:
        out += ["| ranks | torchrun | megaray attached | difference | CPU/rank torchrun | CPU/rank megaray |",
                "|---|---|---|---|---|---|"]  # fmt: skip
        for n, modes in sorted(launch.items(), key=lambda kv: int(kv[0])):
            t, m = modes.get("torchrun", {}), modes.get("megaray-attached", {})
            ts, ms = t.get("seconds", []), m.get("seconds", [])
            tm, mm = (statistics.median(ts) if ts else None), (statistics.median(ms) if ms else None)
            out.append(
                f"| {n} | {_f(tm, '.2f')} s | {_f(mm, '.2f')} s | {_f(_sub(mm, tm), '+.2f')} s | "
                f"{_f(statistics.median(t['rank_cpu']) if t.get('rank_cpu') else None, '.2f')} s | "
                f"{_f(statistics.median(m['rank_cpu']) if m.get('rank_cpu') else None, '.2f')} s |"
            )
    for layout, c in r.get("control", {}).items():
        runs = c.get("megaray", [])
        if not runs:
            continue
        nodes, gpus = map(int, layout.split("x"))
        ranks = nodes * gpus
        phases = ("placed", "actors_ready", "env_set", "finished", "torn_down")
        prev, parts = 0.0, []
        for phase in phases:
            at = statistics.median([x[phase] for x in runs])
            parts.append(f"{phase} {1000 * (at - prev) / ranks:.1f}")
            prev = at
        cpu = "; ".join(
            f"{k[4:]} {1000 * statistics.median([x[k] for x in runs]) / ranks:.1f}"
            for k in runs[0]
            if k.startswith("cpu ")
        )
        tr = c.get("torchrun", [])
        out += ["", f"Control plane {layout} = {ranks} ranks, ms per rank: {', '.join(parts)}; total "
                f"{1000 * prev / ranks:.1f} ms/rank ({prev:.2f} s); torchrun spawning {ranks} `true` workers "
                f"{_f(statistics.median(tr) if tr else None, '.2f')} s. CPU ms per rank: {cpu}."]  # fmt: skip
    return out


def _memory_row(run: str, x: dict[str, Any]) -> str:
    return _row(
        run,
        f"{_f(x.get('peak_allocated_gib'), '.2f')} GiB",
        f"{_f(x.get('peak_reserved_gib'), '.2f')} GiB",
        f"{_f(x.get('megatron_peak_gb'), '.2f')} GB",
        f"{_f(_mb_to_gib(x.get('theoretical_weight_optimizer_mb')), '.2f')} GiB",
    )


def _render_memory(pairs: list[tuple[str, dict[str, Any]]], restart: dict[str, Any] | None) -> list[str]:
    out = [
        "",
        "### 7. Peak GPU memory (`torch.cuda.max_memory_allocated` at the end of `pretrain()`)",
        "",
        _row("run", "peak allocated", "peak reserved", "Megatron's max allocated (iterations 1-2)",
             "bridge's theoretical weights + optimizer"),
        _row("---", "---", "---", "---", "---"),
    ]  # fmt: skip
    for name, r in pairs:
        for launcher in ("torchrun", "megaray"):
            out.append(_memory_row(f"{name}, {launcher}", r.get(launcher, {})))
    if restart and restart.get("memory"):
        out.append(_memory_row("restart model, megaray (warm spares)", restart["memory"]))
    return out


def _mb_to_gib(mb: float | None) -> float | None:
    return None if mb is None else mb * 2**20 / 2**30


def append_section(results_md: Path, section: str) -> None:
    text = results_md.read_text() if results_md.exists() else "# Benchmark results\n"
    results_md.write_text(text.rstrip("\n") + "\n\n" + section)


# -- running (needs the machine) ---------------------------------------------------------------------


class Stamped:
    """A command whose output lines are kept with the seconds since it started, in memory and in
    `log`; tests of what it printed can wait on it while it runs."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str]):
        self.t0 = time.time()
        self.rc: int | None = None
        self.elapsed: float | None = None
        self.lines: list[tuple[float, str]] = []
        self.log = log
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", start_new_session=True,
        )  # fmt: skip
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        with self.log.open("w") as f:
            for line in self.proc.stdout:
                t = time.time() - self.t0
                self.lines.append((t, line.rstrip("\n")))
                f.write(f"{t:9.3f} {line}")
                f.flush()

    def wait_for(self, test, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if test(self):
                return True
            if self.proc.poll() is not None:
                self.reader.join(5)
                return bool(test(self))
            time.sleep(0.05)
        return False

    def finish(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop(signal.SIGKILL)
            return self.proc.wait(30)
        finally:
            self.reader.join(10)

    def stop(self, sig: int = signal.SIGINT) -> None:
        """The launcher first (megaray tears its ranks down on SIGINT), then its whole session."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class Suite:
    def __init__(self, out: Path, budget_s: float):
        self.out = out
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + budget_s
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH")) if p)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def torchrun(self, extra: list[str] | None = None) -> list[str]:
        return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *(extra or []),
                "-m", "launcher.megatron.bridge_target"]  # fmt: skip

    def megaray(self, job: str, extra: list[str] | None = None) -> list[str]:
        return [PY, str(REPO / "main.py"), "--nodes", "1", "--gpus-per-node", "1", "--job-name", job,
                "--runs-dir", str(self.out / "runs"), *(extra or [])]  # fmt: skip

    def run(self, name: str, cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Stamped:
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        s = Stamped(cmd, self.logs / f"{name}.log", env or self.env)
        rc = s.finish(min(timeout_s, max(self.left(), 30)))
        s.elapsed = time.time() - s.t0
        print(f"[{name}] exit {rc} after {s.elapsed:.1f} s", flush=True)
        s.rc = rc
        return s

    def summary(self, job: str) -> dict[str, Any]:
        path = self.out / "runs" / job / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}


def item_pair(suite: Suite, name: str, recipe: list[str], overrides: list[str], skip: int, seq: int,
              what: str) -> dict[str, Any]:  # fmt: skip
    """The same recipe under torchrun, then megaray; parsed, with megaray's progress checked."""
    t = suite.run(f"{name}-torchrun", [*suite.torchrun(), *recipe, *overrides], 420)
    m = suite.run(f"{name}-megaray", [*suite.megaray(f"{name}-megaray"), *recipe, *overrides], 420)
    result: dict[str, Any] = {"what": what, "exit_codes": {"torchrun": t.rc, "megaray": m.rc}}
    runs = {"torchrun": parse_run(t.lines), "megaray": parse_run(m.lines)}
    for launcher, run in runs.items():
        result[launcher] = steady(run, skip)
    progress = suite.summary(f"{name}-megaray").get("progress") or {}
    if progress:
        result["progress"] = compare_progress(progress, runs["megaray"], seq)
    if runs["megaray"]["progress"]:
        result["progress_line"] = runs["megaray"]["progress"][-1]
    result["preflight"] = preflight_lines(m.lines)
    return result


_PREFLIGHT = re.compile(
    r"megaray: (preflight: .*\([\d.]+ s\)|preflight in .*|waited [\d.]+ s for the preflight|the ranks import"
    r"|rank 0 imported .*|starting a local Ray)"
)


def preflight_lines(lines: list[tuple[float, str]]) -> list[str]:
    """megaray's lines on when it started its own Ray (then the ranks import once it is up and they are
    placed), where its preflight ran, how long the ranks waited for it and what rank 0's imports took."""
    return [f"{m.group(1)} (at {t:.1f} s)" for t, line in lines if (m := _PREFLIGHT.search(line))]


def item_warm(suite: Suite, results: dict[str, Any]) -> dict[str, Any]:
    """`megaray up --warm --recipe gpt_small`, then the parity run on it, beside torchrun's first
    iteration from the parity item of this run, else the cold item's median (torchrun run here when
    neither was)."""
    torchrun = (results.get("parity") or {}).get("torchrun") or {}
    cold = (results.get("cold") or {}).get("local") or {}
    if not torchrun.get("first_iteration_s") and cold.get("torchrun_median_s"):
        torchrun = {"first_iteration_s": cold["torchrun_median_s"]}  # the same steps to iteration 1
    if not torchrun.get("first_iteration_s"):
        t = suite.run("warm-torchrun", [*suite.torchrun(), "--recipe", "gpt_small", *PARITY], 420)
        torchrun = steady(parse_run(t.lines), 10)
    env = {**suite.env, "MEGARAY_STATE_DIR": "/tmp/megaray-gpu-suite-state"}
    main_py = str(REPO / "main.py")
    up = suite.run("warm-up-pool", [PY, main_py, "up", "--warm", "--recipe", "gpt_small", "--device", "gpu",
                                    "--gpus-per-node", "1"], 300, env)  # fmt: skip
    try:
        cmd = [*suite.megaray("warm-megaray"), "--recipe", "gpt_small", *PARITY]
        m = suite.run("warm-megaray", cmd, 420, env)
    finally:
        suite.run("warm-down", [PY, main_py, "down"], 120, env)
    megaray = steady(parse_run(m.lines), 10)
    first_t, first_m = torchrun.get("first_iteration_s"), megaray.get("first_iteration_s")
    return {
        "what": "`megaray up --warm --recipe gpt_small --device gpu --gpus-per-node 1`, then the parity run",
        "exit_codes": {"up": up.rc, "megaray": m.rc},
        "up_s": up.elapsed,
        "torchrun_first_iteration_s": first_t,
        "megaray": megaray,
        "ratio": first_m / first_t if first_t and first_m else None,
        "took_pool": any("taking the warm pool" in line for _, line in m.lines),
        "preflight": preflight_lines(m.lines),
    }


def item_cold(suite: Suite, rounds: int, modes: tuple[str, ...] = COLD_MODES) -> dict[str, Any]:
    """`gpt_small` to its first iteration, torchrun and megaray alternately first (`cold_order`), in
    `rounds` rounds per mode: megaray starting its own Ray, then attached to one started here (as a
    cluster's users run it). Nothing is imported ahead in either."""
    from common import ray_cluster

    out: dict[str, Any] = {
        "what": f"`gpt_small` ({' '.join(COLD[:2])}), from the command to iteration 1, {rounds} round(s) per "
        "mode, torchrun and megaray taking turns to go first"
    }
    for mode in modes:
        runs: list[dict[str, Any]] = []
        with contextlib.ExitStack() as stack:
            extra: list[str] = []
            if mode == "attached":
                gpus = 1 if shutil.which("nvidia-smi") else 0
                address = stack.enter_context(ray_cluster(nodes=1, cpus_per_node=os.cpu_count() or 2,
                                                          gpus_per_node=gpus))  # fmt: skip
                extra = ["--address", address]
            for r in range(rounds):
                if suite.left() < 90:
                    break
                run: dict[str, Any] = {"first": cold_order(r)[0], "exit_codes": {}}
                for who in cold_order(r):
                    name = f"cold-{mode}-{r}-{who}"
                    cmd = suite.torchrun() if who == "torchrun" else suite.megaray(name, extra)
                    s = suite.run(name, [*cmd, "--recipe", "gpt_small", *COLD], 300)
                    run["exit_codes"][who] = s.rc
                    run[who] = steady(parse_run(s.lines), 0)["first_iteration_s"]
                    if who == "megaray":
                        run["preflight"] = preflight_lines(s.lines)
                runs.append(run)
        out[mode] = {"runs": runs, **cold_summary(runs)}
    return out


def item_parity(suite: Suite) -> dict[str, Any]:
    return item_pair(suite, "parity", ["--recipe", "gpt_small"], PARITY, skip=10, seq=2048,
                     what="`gpt_small` (16 layers, hidden 2048, seq 2048, micro batch 4, global 8, bf16), 30 "
                     "iterations, steady = median over iterations 11-30")  # fmt: skip


def item_arch(suite: Suite) -> dict[str, Any]:
    recipe = ["--recipe", "qwen3_8b", "--hf-path", str(FIXTURE_QWEN3)]
    return item_pair(suite, "arch", recipe, ARCH, skip=5, seq=4096,
                     what="`qwen3_8b` built from Qwen3-8B's HF config at 2 layers (hidden 4096, vocab "
                     "151936, GQA 32/8), seq 4096, micro batch 1, global 8, bf16, 20 iterations, steady = "
                     "median over iterations 6-20")  # fmt: skip


def _iterations(s: Stamped) -> list[dict[str, Any]]:
    return parse_run(s.lines)["iterations"]


def _gpu_pids() -> list[int] | None:
    """Processes holding a CUDA context, from nvidia-smi (None where it shows none, as in some
    containers)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    q = subprocess.run([smi, "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                       text=True, timeout=30)  # fmt: skip
    pids = [int(x) for x in q.stdout.split() if x.strip().isdigit()]
    return pids or None


def _rank0_pid(suite: Suite, mode: str, job: str, s: Stamped) -> int | None:
    if mode != "torchrun":
        topo = suite.out / "runs" / job / "topology.json"
        return json.loads(topo.read_text())["ranks"][0]["pid"] if topo.exists() else None
    import psutil

    for child in psutil.Process(s.proc.pid).children(recursive=True):
        try:
            if "launcher.megatron.bridge_target" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


_LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")


def resumed(lines: list[tuple[float, str]], after_s: float) -> dict[str, Any] | None:
    """The relaunch after a kill at `after_s`: the iteration bridge loaded and the first iteration it
    then logged (lines of the dying attempt relayed late come before the load and are skipped)."""
    loaded = next(
        (
            (i, int(m.group(1)))
            for i, (t, line) in enumerate(lines)
            if t > after_s and (m := _LOADED.search(line))
        ),
        None,
    )
    if loaded is None:
        return None
    index, at = loaded
    first = next(iter(parse_run(lines[index:])["iterations"]), None)
    return None if first is None else {"resumed_at": at, **first}


def restart_once(suite: Suite, mode: str, ckpt: Path) -> dict[str, Any]:
    job = f"restart-{mode.split()[0]}"
    shutil.rmtree(ckpt, ignore_errors=True)
    overrides = [*RESTART_MODEL, f"checkpoint.save={ckpt}"]
    if mode == "torchrun":
        # torchrun users point checkpoint.load at the save directory themselves (megaray adds it on a
        # relaunch); its relaunched ranks otherwise read stale addresses (pytorch/pytorch#135712).
        env = {**suite.env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        cmd = [*suite.torchrun(["--max-restarts", "1"]), "--recipe", "gpt_small", *overrides,
               f"checkpoint.load={ckpt}"]  # fmt: skip
    else:
        env = suite.env
        flag = "--spares" if mode == "warm spares" else "--no-spares"
        cmd = [*suite.megaray(job, ["--max-restarts", "1", flag]), "--recipe", "gpt_small", *overrides]
    print(f"[restart {mode}] {' '.join(cmd)}", flush=True)
    s = Stamped(cmd, suite.logs / f"{job}.log", env)
    result: dict[str, Any] = {}
    try:
        past = lambda s: any(r["iteration"] >= KILL_AFTER_ITERATION for r in _iterations(s))  # noqa: E731
        if not s.wait_for(past, min(300, suite.left())):
            return {"note": f"never reached iteration {KILL_AFTER_ITERATION}"}
        if mode == "warm spares":
            ready = lambda s: any("warm spare(s) ready" in line for _, line in s.lines)  # noqa: E731
            if not s.wait_for(ready, min(180, suite.left())):
                return {"note": "the spares never became ready"}
        victim = _rank0_pid(suite, mode, job, s)
        if victim is None:
            return {"note": "rank 0's pid not found"}
        holders = _gpu_pids()
        result["gpu_context_pids"] = holders
        before = _iterations(s)
        children = _children(victim)
        phases: list[tuple[float, str]] = []
        sampler = threading.Thread(target=lambda: phases.extend(exit_phases(victim)), daemon=True)
        killed_at = time.time() - s.t0
        os.kill(victim, signal.SIGKILL)
        sampler.start()
        if not s.wait_for(lambda s: resumed(s.lines, killed_at) is not None, min(300, suite.left())):
            return {**result, "note": "no iteration after resuming"}
        first = resumed(s.lines, killed_at)
        same = [r for r in before if r["iteration"] == first["iteration"]]
        result.update(
            restart_s=first["t"] - killed_at,
            resumed_at=first["resumed_at"],
            first_iteration=first["iteration"],
            loss_after=first.get("loss"),
            loss_before=same[0].get("loss") if same else None,
        )
        if mode != "torchrun":
            text = "\n".join(line for _, line in s.lines)
            if m := re.search(r"the warm spares cannot take over \((.*)\): placing", text):
                result["note"] = f"spares not used: {m.group(1)}"
            elif mode == "warm spares":
                result["note"] = "on the warm spares; " + (
                    "nvidia-smi lists no CUDA contexts here"
                    if holders is None
                    else f"CUDA contexts before the kill (nvidia-smi): {len(holders)}, rank 0's included"
                )
            steps = _after_kill(s.lines, killed_at)
            if steps:
                result["note"] = "; ".join(filter(None, [result.get("note"), steps]))
        sampler.join(EXIT_WATCH_S + 1)
        how = ", ".join(f"{what} at +{t:.2f} s" for t, what in phases)
        result["victim_exit"] = f"{how}; {len(children)} child process(es) at the kill"
        return result
    finally:
        s.stop(signal.SIGINT if mode != "torchrun" else signal.SIGTERM)
        s.reader.join(10)
        result["memory"] = parse_run(s.lines)
        shutil.rmtree(ckpt, ignore_errors=True)


EXIT_WATCH_S = 15.0


def exit_phase(stat_text: str | None, status_text: str | None) -> str:
    """Where a killed process is in its exit, read as megaray's node watch reads /proc
    (core/deaths.py `process_end`, whose flags it uses): a SIGKILL still pending, exiting
    (PF_EXITING), a zombie, or gone; the watch only needs to know that it is ending."""
    if stat_text is None:
        return "gone"
    fields = stat_text[stat_text.rindex(")") + 2 :].split()
    state, flags = fields[0], int(fields[6])
    if state in ("Z", "X"):
        return "zombie"
    if flags & PF_EXITING:
        return f"exiting ({state})"
    for line in (status_text or "").splitlines():
        key, _, mask = line.partition(":")
        if key in ("SigPnd", "ShdPnd") and int(mask.strip() or "0", 16) & SIGKILL_PENDING:
            return f"SIGKILL pending ({state})"
    return f"running ({state})"


def _proc(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def exit_phases(pid: int, seconds: float = EXIT_WATCH_S, every_s: float = 0.01) -> list[tuple[float, str]]:
    """Each change of `exit_phase` for `pid`, in seconds from the call, until it has exited: why the
    driver learned of a kill when it did (the watch sees the exit begin; Ray reports the process
    once it is gone)."""
    t0, last, out = time.monotonic(), None, []
    while time.monotonic() - t0 < seconds:
        what = exit_phase(_proc(f"/proc/{pid}/stat"), _proc(f"/proc/{pid}/status"))
        if what != last:
            out.append((time.monotonic() - t0, what))
            last = what
        if what in ("zombie", "gone"):  # exited: its parent reaps it
            break
        time.sleep(every_s)
    return out


def _children(pid: int) -> list[int]:
    """The processes `pid` started (a checkpoint save's writers, say) when it is killed."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


AFTER_KILL = (
    ("failure seen", re.compile(r"restart 1 of 1 after: ")),
    ("spares took over", re.compile(r"the spares took over: (.*)")),
    # which report told it: the node's watch of the process ending ("killed by SIGKILL") or Ray's
    # report of the death, seconds later where the process held GPU memory
    ("root cause", re.compile(r"^\s*what\s*: (.*)")),
)


def _after_kill(lines: list[tuple[float, str]], killed_at: float) -> str:
    """When megaray saw the failure, its spares took over and it reported the root cause, in seconds
    after the kill."""
    out = []
    for what, pattern in AFTER_KILL:
        hit = next(((t, m) for t, line in lines if t >= killed_at and (m := pattern.search(line))), None)
        if hit is not None:
            detail = f" ({hit[1].group(1)})" if hit[1].groups() else ""
            out.append(f"{what} at +{hit[0] - killed_at:.2f} s{detail}")
    return ", ".join(out)


RESTART_MODES = ("warm spares", "cold", "torchrun")


def item_restart(suite: Suite, modes: tuple[str, ...] = RESTART_MODES) -> dict[str, Any]:
    ckpt = Path("/tmp/megaray-gpu-suite-ckpt")
    out: dict[str, Any] = {
        "what": "`gpt_small` cut to 4 layers, hidden 1024, seq 1024, checkpoint every 5 iterations, SIGKILL "
        f"of rank 0's process once iteration {KILL_AFTER_ITERATION} is logged (and, on warm spares, once the "
        "driver logged them ready); `--max-restarts 1` for all three, torchrun with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    }
    for mode in modes:
        if suite.left() < 60:
            out[mode] = {"note": "skipped: out of time"}
            continue
        out[mode] = restart_once(suite, mode, ckpt)
        print(f"[restart {mode}] {json.dumps({k: v for k, v in out[mode].items() if k != 'memory'})}",
              flush=True)  # fmt: skip
    warm = out.get("warm spares", {})
    if warm.get("memory"):
        out["memory"] = {k: v for k, v in warm["memory"].items() if k not in ("iterations", "progress")}
    for mode in ("warm spares", "cold", "torchrun"):
        out.get(mode, {}).pop("memory", None)
    return out


def item_doctor(suite: Suite) -> dict[str, Any]:
    from common import ray_cluster

    gpus = 1 if shutil.which("nvidia-smi") else 0
    device = ["--device", "gpu" if gpus else "cpu"]
    with ray_cluster(nodes=1, cpus_per_node=os.cpu_count() or 2, gpus_per_node=gpus) as address:
        s = suite.run("doctor", [PY, str(REPO / "main.py"), "doctor", "--address", address, "--nodes", "1",
                                 "--gpus-per-node", "1", *device], 180)  # fmt: skip
    return {"exit_code": s.rc, "output": "\n".join(line for _, line in s.lines)}


def item_overhead(
    suite: Suite, ranks: list[int], layouts: list[str], repeats: int, modes: tuple[str, ...] = OVERHEAD_MODES
) -> dict[str, Any]:
    import control_plane

    launch = launch_overhead.main(["--ranks", *map(str, ranks), "--repeats", str(repeats),
                                   "--modes", *modes])  # fmt: skip
    control = control_plane.main(["--layouts", *layouts, "--repeats", "1"]) if layouts else {}
    return {"launch": {str(k): v for k, v in launch.items()}, "control": control}


def environment() -> dict[str, Any]:
    from importlib import metadata

    env: dict[str, Any] = {"python": ".".join(map(str, sys.version_info[:3])), "cores": os.cpu_count()}
    for dist in ("torch", "ray", "megatron-core", "megatron-bridge", "transformer-engine"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = None
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
        first = q.stdout.strip().splitlines()[:1]
        if first:
            env["gpu"], env["driver"] = (x.strip() for x in first[0].split(",", 1))
    try:
        import torch

        env["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/gpu_suite.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/megaray-gpu-suite"))
    p.add_argument("--only", default=",".join(ITEMS), help=f"comma-separated, of {','.join(ITEMS)}")
    p.add_argument("--results", type=Path, help="append the section to this RESULTS.md")
    p.add_argument("--render", type=Path, nargs="+", help="merge these results.json files; run nothing")
    p.add_argument("--budget-s", type=float, default=570, help="stop starting work after this long")
    p.add_argument("--overhead-ranks", type=int, nargs="+", default=[8, 16])
    p.add_argument("--overhead-modes", default=",".join(OVERHEAD_MODES), help="of the overhead item: a "
                   "comma-separated subset of " + ",".join(launch_overhead.MODES))  # fmt: skip
    p.add_argument("--control-layouts", nargs="*", default=["8x8"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cold-rounds", type=int, default=2, help="of the cold item: rounds per mode")
    p.add_argument("--cold-modes", default=",".join(COLD_MODES), help="of the cold item: a comma-separated "
                   "subset of " + ",".join(COLD_MODES))  # fmt: skip
    p.add_argument("--restart-modes", default=",".join(RESTART_MODES), help="of the restart item: a comma-"
                   "separated subset of " + ",".join(RESTART_MODES))  # fmt: skip
    args = p.parse_args(argv)
    args.items = [x for x in args.only.split(",") if x]
    unknown = sorted(set(args.items) - set(ITEMS))
    if unknown:
        p.error(f"--only: unknown item(s) {', '.join(unknown)}; choose from {', '.join(ITEMS)}")
    # the modes of the cold and restart items, parsed and checked here: an unknown one found by its item
    # would cost device time first
    for flag, attr, known in (
        ("--cold-modes", "cold_modes", COLD_MODES),
        ("--restart-modes", "restart_modes", RESTART_MODES),
        ("--overhead-modes", "overhead_modes", launch_overhead.MODES),
    ):
        modes = tuple(getattr(args, attr).split(","))
        if bad := sorted(set(modes) - set(known)):
            p.error(f"{flag}: unknown mode(s) {', '.join(bad)}; choose from {', '.join(known)}")
        setattr(args, attr, modes)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        merged: dict[str, Any] = {}
        for path in args.render:
            merged.update(json.loads(path.read_text()))
        section = render(merged)
        print(section)
        if args.results:
            append_section(args.results, section)
        return 0
    suite = Suite(args.out, args.budget_s)
    results: dict[str, Any] = {"date": datetime.date.today().isoformat(), "env": environment()}
    print(f"environment: {json.dumps(results['env'])}", flush=True)
    runners = {
        "parity": lambda: item_parity(suite),
        "cold": lambda: item_cold(suite, args.cold_rounds, args.cold_modes),
        "warm": lambda: item_warm(suite, results),
        "arch": lambda: item_arch(suite),
        "restart": lambda: item_restart(suite, args.restart_modes),
        "doctor": lambda: item_doctor(suite),
        "overhead": lambda: item_overhead(
            suite, args.overhead_ranks, args.control_layouts, args.repeats, args.overhead_modes
        ),
    }
    if {"parity", "cold", "warm", "arch", "restart"} & set(args.items):
        suite.run("warm-up", [PY, "-c", WARM_UP], 180)
    for item in args.items:
        if suite.left() < 30:
            results[item] = {"error": "skipped: out of time"}
            continue
        t0 = time.monotonic()
        try:
            results[item] = runners[item]()
        except Exception as e:  # one item's failure must not lose the others' figures
            results[item] = {"error": f"{type(e).__name__}: {e}"}
        print(f"== {item} done in {time.monotonic() - t0:.0f} s", flush=True)
        (suite.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    section = render(results)
    (suite.out / "section.md").write_text(section)
    print(section, flush=True)
    if args.results:
        append_section(args.results, section)
    with tarfile.open(suite.out / "logs.tar.gz", "w:gz") as tar:
        tar.add(suite.logs, arcname="logs")
        if (suite.out / "runs").exists():
            tar.add(suite.out / "runs", arcname="runs")
    shutil.rmtree(suite.logs, ignore_errors=True)
    shutil.rmtree(suite.out / "runs", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
