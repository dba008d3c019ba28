"""The benchmarks run, at a tiny size (no timing is asserted: numbers go to bench/RESULTS.md)."""

from __future__ import annotations

import sys

import pytest

from .conftest import REPO, ray_starting

sys.path.insert(0, str(REPO / "bench"))


@pytest.fixture(autouse=True)
def _benches_start_ray_as_the_suite_does():
    """Each Ray a bench starts in this process waits for the turn the suite's own starts take
    (conftest.ray_starting): CI failed the failures bench's head on Ray's 30 s beside the others."""
    import common

    common.start_ray_with(ray_starting)


def test_teardown_measures_both_launchers(capsys):
    import teardown

    results = teardown.main(["--ranks", "2", "--repeats", "1", "--handler-s", "0.5", "--driver-signal"])
    assert all(gone > 0 for runs in results.values() for gone, _ in runs)
    handled = results["megaray (SIGTERM handler 0.5s)"][0][0]
    assert handled >= 0.5  # the surviving rank's handler ran to its end before the process went
    out = capsys.readouterr().out
    assert (
        "megaray/torchrun (ranks gone): " in out
        and "megaray/torchrun (ranks gone) (SIGTERM handler 0.5s)" in out
    )
    assert "SIGTERM to the launcher" in out and "megaray/torchrun (exited): " in out
    signaled = results["SIGTERM to the launcher: megaray"]
    assert len(signaled) == 1 and 0 < signaled[0][0] <= signaled[0][1]  # its ranks gone before it exits


def test_failures_times_rank_death_node_loss_and_a_hang(capsys):
    import failures

    # a cold restart is the warm one's path less the spares (tests/test_restarts.py runs both)
    modes = "warm spares,torchrun"
    results = failures.main(
        ["--repeats", "1", "--hang-timeout", "2", "--trainer", "loop", "--restart-modes", modes]
    )
    restarts = {f"restart {m}" for m in modes.split(",")}
    assert set(results) == {"rank death", "node loss", "hang"} | restarts
    assert all(len(results[s]) == 1 and results[s][0][0] > 0 for s in ("rank death", "node loss", "hang"))
    assert all(len(results[r]) == 1 and results[r][0] > 0 for r in restarts)
    out = capsys.readouterr().out
    assert "NCCL's watchdog" in out and "megaray/torchrun: warm spares" in out


def test_ray_assumptions_are_measured(capsys):
    import ray_assumptions

    results = ray_assumptions.main(["--actors", "20", "--groups", "4", "--repeats", "1"])
    assert results["held"] == {"default group": False, "own group": True}  # Ray's semantics, not a timing
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("unnamed_ms=") and "own_group_runs=1" in last


def _last_line_fields(cmd: list[str]) -> dict[str, str]:
    import subprocess

    p = subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(kv.split("=", 1) for kv in p.stdout.strip().splitlines()[-1].split())


def test_the_scale_simulation_runs_the_real_driver_to_its_end_and_through_a_failure():
    """bench/scale_sim.py: megaray's launch() against the stand-in Ray, at a tiny size."""
    # the console's lag is measured on the lines that arrive once the launch is running: 8 s, so that
    # some still come where a loaded machine took the 3 s it ran for to start all 64 (a fresh-clone run)
    ok = _last_line_fields(["bench/scale_sim.py", "--ranks", "64", "--run-s", "8"])
    assert ok["outcome"] == "ok" and float(ok["running_s"]) > 0 and ok["max_console_lag_s"] != "-"
    assert float(ok["launch_sync_rpcs_per_node"]) >= 1  # a placement group per node, at least
    failed = _last_line_fields(["bench/scale_sim.py", "--ranks", "64", "--run-s", "4", "--fail", "rank"])
    assert failed["outcome"] == "RankFailedError" and 10 <= int(failed["failure_report_lines"]) <= 30


def test_the_output_simulation_loses_nothing():
    """bench/output_sim.py: the sink and the nodes' forwarders, unchanged, at a tiny size."""
    out = _last_line_fields(["bench/output_sim.py", "--ranks", "64", "--seconds", "3", "--startup-s", "0.5"])
    assert int(out["written"]) > 0 and out["lost"] == "0"
