"""The GPU suite's plumbing on CPU: its parsing of bridge's log, its RESULTS section, its arguments, and
the items that need no GPU run end to end (the GPU items run only on a GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest

from .conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import control_plane
import gpu_suite

# Lines as Megatron-Bridge 0.6.2 prints them (training/utils/train_utils.py, theoretical_memory_utils.py,
# checkpointing.py), through megaray's console prefix, with the suite's time stamps.
ITERATION = (
    "{t:9.3f} [r0 n0]  [2026-11-23 10:00:00] iteration {i:8d}/{n:8d} | consumed samples: {s:12d} | "
    "elapsed time per iteration (ms): {ms:.1f} | throughput per GPU (TFLOP/s/GPU): {tf:.1f} | "
    "learning rate: 1.000000E-04 | global batch size:     8 | lm loss: {loss:.6E} | loss scale: 1.0 | "
    "grad norm: 3.210 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)
EXTRA = [
    "{t:9.3f} [r0 n0] Theoretical memory footprints: weight and optimizer=16345.25 MB",
    "{t:9.3f} [r0 n0] [Rank 0] (after 1 iterations) memory (GB) | mem-allocated-gigabytes: 17.1 | "
    "mem-max-allocated-gigabytes: 45.02 | mem-reserved-gigabytes: 48.3",
    "{t:9.3f} [r0 n0] [Rank 0] (after 2 iterations) memory (GB) | mem-max-allocated-gigabytes: 49.7",
    "{t:9.3f} [r0 n0] megaray: rank 0 peak GPU memory: 46.30 GiB allocated, 52.10 GiB reserved",
    "{t:9.3f} megaray: progress: iteration 30/30 | loss 1.39 | 33.8k tokens/s | 300.1 TFLOP/s/GPU",
]


def _log(n: int = 30, ms: float = 480.0, loss0: float = 10.8) -> str:
    lines = [
        ITERATION.format(t=40 + i * ms / 1000, i=i, n=n, s=8 * i, ms=ms + (50 if i == 1 else 0),
                         tf=300.0, loss=loss0 - i / 10)
        for i in range(1, n + 1)
    ]  # fmt: skip
    lines += [x.format(t=60.0) for x in EXTRA]
    return "\n".join(lines) + "\n"


def test_parse_and_steady_read_bridge_lines_through_megarays_prefixes():
    run = gpu_suite.parse_run(gpu_suite.read_stamped(_log()))
    assert len(run["iterations"]) == 30
    first = run["iterations"][0]
    assert first == {
        "t": pytest.approx(40.48), "iteration": 1, "total": 30, "ms": 530.0, "tflops": 300.0,
        "global_batch": 8, "loss": pytest.approx(10.7),
    }  # fmt: skip
    s = gpu_suite.steady(run, skip=10)
    assert (s["steady_ms"], s["n"], s["first_iteration_s"]) == (480.0, 20, pytest.approx(40.48))
    assert s["loss_first"] == pytest.approx(10.7) and s["loss_last"] == pytest.approx(7.8)
    assert s["peak_allocated_gib"] == 46.30 and s["peak_reserved_gib"] == 52.10
    assert s["megatron_peak_gb"] == 49.7  # the larger of the two reports
    assert s["theoretical_weight_optimizer_mb"] == 16345.25
    assert run["progress"] == ["iteration 30/30 | loss 1.39 | 33.8k tokens/s | 300.1 TFLOP/s/GPU"]


def test_progress_is_compared_with_megatrons_own_figures_for_the_same_iteration():
    run = gpu_suite.parse_run(gpu_suite.read_stamped(_log()))
    ours = {"iteration": 30, "tokens_per_s": 8 * 2048 / 0.48 * 1.01, "tflops_per_gpu": 297.0}
    p = gpu_suite.compare_progress(ours, run, seq_length=2048)
    assert p["megatron_tokens_per_s"] == pytest.approx(8 * 2048 / 0.48)
    assert p["tokens_per_s_diff"] == pytest.approx(0.01)
    assert p["tflops_diff"] == pytest.approx(-0.01)
    assert "error" in gpu_suite.compare_progress({"iteration": 99}, run, seq_length=2048)


def test_the_relaunch_is_found_after_the_checkpoint_load_not_in_late_lines_of_the_dead_rank():
    lines = gpu_suite.read_stamped(
        "\n".join(
            [
                ITERATION.format(t=10.0, i=12, n=200, s=96, ms=150.0, tf=50.0, loss=6.5),
                ITERATION.format(t=10.2, i=13, n=200, s=104, ms=150.0, tf=50.0, loss=6.4),  # relayed late
                "   14.000 [r0 n0]   successfully loaded checkpoint from /tmp/ckpt [ t 0/1, p 0/1 ] "
                "at iteration 10",
                ITERATION.format(t=15.5, i=11, n=200, s=88, ms=900.0, tf=9.0, loss=6.61),
            ]
        )
    )
    found = gpu_suite.resumed(lines, after_s=10.1)
    assert (found["resumed_at"], found["iteration"], found["t"], found["loss"]) == (10, 11, 15.5, 6.61)
    assert gpu_suite.resumed(lines[:2], after_s=10.1) is None


def _results() -> dict:
    run = gpu_suite.steady(gpu_suite.parse_run(gpu_suite.read_stamped(_log())), skip=10)
    pair = {"what": "gpt_small", "torchrun": run, "megaray": {**run, "steady_ms": 482.4},
            "progress": {"iteration": 30, "megaray_tokens_per_s": 34000.0, "megatron_tokens_per_s": 34133.3,
                         "tokens_per_s_diff": -0.0039, "megaray_tflops": 300.0, "megatron_tflops": 300.0,
                         "tflops_diff": 0.0}}  # fmt: skip
    return {
        "date": "2026-11-23",
        "env": {
            "gpu": "NVIDIA H100 80GB HBM3",
            "driver": "580.1",
            "cuda": "13.0",
            "cores": 16,
            "python": "3.12.3",
            "torch": "2.11.0",
            "ray": "2.60.0",
            "megatron-core": "0.19.2",
            "megatron-bridge": "0.6.2",
            "transformer-engine": None,
        },
        "parity": {**pair, "preflight": ["waited 1.2 s for the preflight (at 30.0 s)"]},
        "cold": {
            "what": "gpt_small to iteration 1",
            "local": {
                "runs": (
                    local := [
                        {
                            "first": "torchrun",
                            "torchrun": 20.0,
                            "megaray": 19.0,
                            "exit_codes": {"torchrun": 0, "megaray": 0},
                        },
                        {
                            "first": "megaray",
                            "torchrun": 22.0,
                            "megaray": 20.0,
                            "exit_codes": {"torchrun": 0, "megaray": 1},
                            "preflight": ["the ranks import (at 4.1 s)"],
                        },
                    ]
                ),
                **gpu_suite.cold_summary(local),
            },
        },
        "warm": {
            "what": "up --warm --recipe gpt_small",
            "exit_codes": {"up": 0, "megaray": 0},
            "up_s": 31.0,
            "torchrun_first_iteration_s": 33.4,
            "megaray": {**run, "first_iteration_s": 12.1},
            "ratio": 12.1 / 33.4,
            "took_pool": True,
            "preflight": ["preflight in a warm pool's process, bridge imported there (1.1 s) (at 3.0 s)"],
        },
        "arch": {**pair, "what": "qwen3 2 layers"},
        "restart": {
            "what": "small GPT",
            "warm spares": {
                "restart_s": 9.5,
                "resumed_at": 10,
                "loss_before": 6.6,
                "loss_after": 6.61,
                "note": "on the warm spares",
            },
            "cold": {"restart_s": 41.0, "resumed_at": 10},
            "torchrun": {"note": "no iteration after resuming"},
            "memory": {"peak_allocated_gib": 5.5},
        },
        "doctor": {"exit_code": 0, "output": "nodes (1):\n  node  ip\nall-reduce over 1 ranks (nccl 2.27.3)"},
        "overhead": {
            "launch": {
                "8": {
                    "torchrun": {"seconds": [5.0, 5.2], "rank_cpu": [2.0]},
                    "megaray-attached": {"seconds": [6.0, 6.4], "rank_cpu": [3.0]},
                }
            },
            "control": {
                "2x1": {
                    "megaray": [
                        {
                            "placed": 0.1,
                            "actors_ready": 1.0,
                            "env_set": 1.1,
                            "finished": 1.2,
                            "torn_down": 1.3,
                            "cpu driver": 0.1,
                            "cpu gcs": 0.05,
                        }
                    ],
                    "torchrun": [2.0],
                }
            },
        },
    }


def test_the_section_names_every_item_with_both_launchers(tmp_path):
    section = gpu_suite.render(_results())
    assert section.startswith("## GPU suite (`bench/gpu_suite.sh`), 2026-11-23")
    assert "NVIDIA H100 80GB HBM3 (driver 580.1, CUDA 13.0), 16 cores" in section
    assert "TransformerEngine not installed" in section
    for heading in ("### 1.", "### 2.", "### 3.", "### 5.", "### 6.", "### 7."):
        assert heading in section
    assert "ratio 1.0050" in section  # 482.4 / 480.0
    assert "- waited 1.2 s for the preflight (at 30.0 s)" in section
    # the cold item: medians 21.0 and 19.5, each round's ratio 0.95 and 0.91; attached not run
    assert (
        "| megaray starting its own Ray | 2 (torchrun, megaray) | 21.0 s | 19.5 s | **0.93x** | 0.95, 0.91 |"
        in section
    )
    assert "attached to a running Ray" not in section
    assert "megaray's preflight, local, round 2:\n- the ranks import (at 4.1 s)" in section
    assert "local, round 2: exit codes {'torchrun': 0, 'megaray': 1}" in section
    assert [gpu_suite.cold_order(r)[0] for r in range(3)] == ["torchrun", "megaray", "torchrun"]
    assert gpu_suite.cold_summary([{"torchrun": None, "megaray": 3.0}])["ratio_of_medians"] is None
    assert (
        "### 1b. On a warm recipe pool" in section
        and "| command start to iteration 1 | 33.4 s | 12.1 s | 0.36 |" in (section)
    )
    assert "the launch took the pool (exit 0)" in section and "(1.1 s) (at 3.0 s)" in section
    lines = gpu_suite.read_stamped(
        "  0.600 megaray: starting a local Ray for this run (attach to a running cluster with --address)\n"
        "  2.000 megaray: preflight in a warm pool's process, bridge imported there (1.1 s)\n"
        "  3.000 megaray: preflight: TP 1 x PP 1 fits 1 rank(s) (0.9 s)\n  4.0 other\n"
    )
    assert gpu_suite.preflight_lines(lines) == [
        "starting a local Ray (at 0.6 s)",
        "preflight in a warm pool's process, bridge imported there (1.1 s) (at 2.0 s)",
        "preflight: TP 1 x PP 1 fits 1 rank(s) (0.9 s) (at 3.0 s)",
    ]
    assert "identical per iteration" in section  # the same losses in both runs
    assert "4. Progress view against bridge's own log, iteration 30" in section and "(-0.39%)" in section
    assert "| megaray, warm spares | 9.50 s | 10 | 6.600 -> 6.610 | on the warm spares |" in section
    assert "| torchrun | n/a s | n/a | n/a -> n/a | no iteration after resuming |" in section
    assert "nccl 2.27.3" in section
    assert "| 8 | 5.10 s | 6.20 s | +1.10 s | 2.00 s | 3.00 s |" in section
    assert "Control plane 2x1 = 2 ranks" in section
    assert "| parity, megaray | 46.30 GiB | 52.10 GiB | 49.70 GB | 15.96 GiB |" in section
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n\nearlier\n")
    gpu_suite.append_section(results_md, section)
    assert results_md.read_text() == "# Benchmark results\n\nearlier\n\n" + section


def test_arguments_and_merging_two_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_suite.parse_args(["--only", "parity,bogus"])
    assert e.value.code == 2
    assert "unknown item(s) bogus" in capsys.readouterr().err
    assert gpu_suite.parse_args(["--only", "restart"]).items == ["restart"]
    full = _results()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({k: full[k] for k in ("date", "env", "parity", "arch")}))
    b.write_text(json.dumps({k: full[k] for k in ("date", "env", "restart")}))
    results_md = tmp_path / "RESULTS.md"
    assert gpu_suite.main(["--render", str(a), str(b), "--results", str(results_md)]) == 0
    text = results_md.read_text()
    assert "### 1." in text and "### 3." in text and "### 5." not in text


@pytest.mark.slow
def test_the_items_that_need_no_gpu_run_end_to_end_on_cpu(tmp_path):
    """The doctor and the overhead item, whose launch modes here are the table's two and one on
    `megaray up --warm` (bench/launch_overhead.py's every kind of launch but the `megaray up` without
    --warm and a Ray started for the run, which the one-node tests start anyway: formerly also a run
    of launch_overhead.py of its own in test_bench.py, with a torchrun run of its own)."""
    out = tmp_path / "out"
    results_md = tmp_path / "RESULTS.md"
    modes = ("torchrun", "megaray-attached", "megaray-up-warm")
    p = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_suite.py"), "--out", str(out), "--only", "doctor,overhead",
         "--overhead-ranks", "2", "--control-layouts", "2x1", "--repeats", "1", "--results", str(results_md),
         "--overhead-modes", ",".join(modes)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["doctor"]["exit_code"] == 0, results["doctor"]
    assert "all-reduce over 1 ranks (gloo)" in results["doctor"]["output"]
    launch = results["overhead"]["launch"]["2"]
    assert set(launch) == set(modes)
    assert all(len(v["seconds"]) == 1 and v["seconds"][0] > 0 for v in launch.values())
    assert all(v["rank_cpu"][0] > 0 and v["exit_seconds"][0] >= v["seconds"][0] for v in launch.values())
    assert "s vs torchrun" in p.stdout and "a rank's CPU by the barrier" in p.stdout, p.stdout[-3000:]
    assert "command exited at" in p.stdout, p.stdout[-3000:]
    # bench/control_plane.py, end to end (formerly also a test of its own in test_bench.py)
    run = results["overhead"]["control"]["2x1"]["megaray"][0]
    assert 0 < run["placed"] <= run["actors_ready"] <= run["finished"] <= run["torn_down"]
    assert run["cpu rank process"] > 2 * 0.1  # every rank reported its own process's CPU
    assert all(run[f"cpu {part}"] >= 0 for part in control_plane.CPU_PARTS)
    assert "ms/rank" in p.stdout and "CPU ms per rank" in p.stdout
    section = (out / "section.md").read_text()
    assert "### 5. `megaray doctor`" in section and "| 2 |" in section
    assert results_md.read_text().endswith(section)
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "logs/doctor.log" in tar.getnames()


def test_an_unknown_overhead_mode_is_refused_before_any_item_runs():
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["--overhead-modes", "torchrun,megaray-fast"])
    assert gpu_suite.parse_args([]).overhead_modes == ("torchrun", "megaray-attached")


def test_a_killed_process_s_way_out_is_read_as_the_node_watch_reads_it():
    """The restart item records how rank 0's process exits after the kill (a SIGKILL pending, exiting,
    a zombie, gone): on a GPU that takes seconds, and says why the driver learned of it when it did."""
    stat = "893 (python3 (x)) {state} 1 1 1 0 -1 {flags} " + " ".join(["0"] * 43)
    pending = "Name:\tpython3\nSigPnd:\t0000000000000100\nShdPnd:\t0000000000000000\n"
    assert gpu_suite.exit_phase(stat.format(state="D", flags=0), pending) == "SIGKILL pending (D)"
    assert gpu_suite.exit_phase(stat.format(state="R", flags=0x4), "") == "exiting (R)"
    assert gpu_suite.exit_phase(stat.format(state="Z", flags=0x4), "") == "zombie"
    assert gpu_suite.exit_phase(stat.format(state="S", flags=0), "SigPnd:\t0\n") == "running (S)"
    assert gpu_suite.exit_phase(None, None) == "gone"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.kill()
    phases = gpu_suite.exit_phases(child.pid, seconds=5)
    child.wait()
    assert phases and phases[-1][1] in ("zombie", "gone")
