"""`megaray up` / `megaray down`, run as users run them (fresh processes): a local Ray that launches
without an address attach to, the precedence of addresses, and nothing left running after `down`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture
def env():
    e = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    # not the user's own `megaray up`; short, for the Unix sockets under Ray's temp dir in there
    e["MEGARAY_STATE_DIR"] = tempfile.mkdtemp(prefix="mru-", dir="/tmp")
    yield e
    shutil.rmtree(e["MEGARAY_STATE_DIR"], ignore_errors=True)


def megaray(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "main.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def processes_under(path: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if path in cmdline:
                found.append(f"{entry.name}: {cmdline[:120]}")
    return found


def test_up_holds_a_local_ray_that_launches_attach_to_and_down_leaves_nothing(env, tmp_path):
    state = env["MEGARAY_STATE_DIR"]
    try:
        up = megaray(env, "up", "--nodes", "2", "--gpus-per-node", "2")
        assert up.returncode == 0, up.stderr[-3000:]
        assert re.search(r"started a local Ray at 127\.0\.0\.1:\d+ \(2 node\(s\) x 2 CPU ranks\)", up.stderr)
        again = megaray(env, "up")
        assert again.returncode == 0 and "already running at 127.0.0.1:" in again.stderr

        runs = str(tmp_path / "runs")
        args = [
            "--device",
            "cpu",
            "--nodes",
            "2",
            "--gpus-per-node",
            "2",
            "--log-ranks",
            "all",
            "--runs-dir",
            runs,
        ]
        launched = megaray(env, *args, "examples/torchrun_script.py")
        out = launched.stdout + launched.stderr
        assert launched.returncode == 0, out[-3000:]
        assert "attaching to the local Ray of `megaray up`" in out and "starting a local Ray" not in out
        assert len(re.findall(r"sum=(\d+) expected=\1\b", out)) == 4
        assert re.search(r"^\s+3\s+1\s", out, flags=re.M)  # rank 3 on node 1: the two nodes of `up`

        # precedence: --address, then RAY_ADDRESS, before a running `megaray up`
        for extra, more_env in ((["--address", "127.0.0.1:9"], {}), ([], {"RAY_ADDRESS": "127.0.0.1:9"})):
            refused = megaray({**env, **more_env}, *extra, "--device", "cpu", "examples/torchrun_script.py")
            assert refused.returncode == 2 and "cannot reach a Ray cluster at 127.0.0.1:9" in refused.stderr
    finally:
        down = megaray(env, "down")
    assert down.returncode == 0 and "stopped the local Ray at 127.0.0.1:" in down.stderr, down.stderr
    assert "killed" not in down.stderr  # every node stopped on its SIGTERM
    assert processes_under(state) == []
    assert not (Path(state) / "up.json").exists()
    again = megaray(env, "down")
    assert again.returncode == 0 and "no `megaray up` is running" in again.stderr


def test_up_refuses_simulated_gpu_nodes_in_one_line(env):
    p = megaray(env, "up", "--nodes", "2", "--device", "gpu")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "use --device cpu" in p.stderr
    assert not (Path(env["MEGARAY_STATE_DIR"]) / "up.json").exists()
