"""The README's demo, run the way a user runs it: no cluster address, simulated nodes, a subprocess."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from . import drive


def test_readme_demo_dry_run_on_two_simulated_nodes():
    p = drive.run("--dry-run", "--nodes", "2", "--gpus-per-node", "2")  # the README's demo
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "simulating 2 node(s) x 2 declared GPUs" in out
    rows = re.findall(r"^\s+(\d)\s+(\d)\s+\S+\s+\S+\s+(\d)\s+(\d)\s+\d+$", out, flags=re.M)
    assert [(int(r), int(n), int(lr)) for r, n, lr, _ in rows] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert "dry run passed: 4 ranks on 2 node(s)" in out
    if importlib.util.find_spec("megatron.core") is None:
        return  # the demo of a clone without the extras (as .ci/run runs it first)
    # with the megatron extra it trains (this test also stands for the dry run on a multi-node cluster,
    # which test_multi_node ran the same way, attached: its other tests cover attaching)
    trained = r"Megatron GPT trained on CPU with TP 2 x PP 2 x DP 1: loss ([\d.]+) -> ([\d.]+) over 20 steps"
    found = re.search(trained, out)
    assert found, out
    first, last = float(found.group(1)), float(found.group(2))
    assert abs(first - math.log(128)) < 0.3  # a fresh model: uniform over the 128-token vocabulary
    assert last < 0.7 * first  # it learns
    assert "last-stage ranks agreeing: 2" in out
    # progress, reported by one last-stage rank, shown by the driver as plain lines (no terminal)
    assert re.search(r"progress: iteration 20/20 \| loss [\d.]+ \| [\d.]+k? tokens/s \| ETA 0s", out), out


# a row of the launch's topology table for a CPU rank: rank, node, ..., local_rank, no GPU, pid
TOPOLOGY_ROW = r"^\s+(\d)\s+(\d)\s+\S+\s+\S+\s+(\d)\s+-\s+\d+$"


def test_a_plain_torchrun_script_runs_locally_on_more_ranks_than_cores():
    # No address: 4 ranks on this 2-core machine, as torchrun would start them. (On 2 simulated nodes, a
    # program of the user's: test_local_ranks_get_the_shells_variables_but_not_its_sessions; a gloo
    # all-reduce across them: the README's demo.)
    p = drive.run("--device", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--log-ranks", "all",
                  "examples/torchrun_script.py")  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    rows = re.findall(TOPOLOGY_ROW, out, flags=re.M)
    assert {int(n) for _, n, _ in rows} == {0} and len(rows) == 4
    assert out.count("sum=6 expected=6") == 4


def test_a_gpu_launch_on_a_machine_without_gpus_is_refused_before_a_ray_starts():
    from launcher.driver.cluster.rayprivate import local_gpu_count

    if local_gpu_count():
        pytest.skip("this machine has GPUs")
    p = drive.run("--nodes", "1", "--gpus-per-node", "1", "examples/torchrun_script.py")
    assert p.returncode == 2 and "has no GPU for a local Ray: --device cpu runs the ranks" in p.stderr
    assert "starting a local Ray" not in p.stderr and "Traceback" not in p.stderr, p.stderr


ENV_PROBE = """
import json, os, sys
keys = ("ACCELERATE_USE_CPU", "MY_PASSWORD", "NCCL_DEBUG", "HF_HUB_OFFLINE", "RANK", "FOO", "SLURM_PROCID",
        "XDG_RUNTIME_DIR")
open(os.path.join(sys.argv[1], f"env-{os.environ['RANK']}.json"), "w").write(
    json.dumps({k: os.environ.get(k) for k in keys})
)
print("done")
"""


# What the shell exports for the program, and what describes the driver's own session (a Slurm step's
# rank, a login's runtime dir): the first reaches every rank, as under torchrun; the second does not.
SHELL_VARS = {"ACCELERATE_USE_CPU": "true", "MY_PASSWORD": "hunter2", "NCCL_DEBUG": "INFO", "FOO": "1",
              "SLURM_PROCID": "7", "XDG_RUNTIME_DIR": "/run/user/1000"}  # fmt: skip


def expected_env(rank: int) -> dict[str, str | None]:
    return {"ACCELERATE_USE_CPU": "true", "MY_PASSWORD": "hunter2", "NCCL_DEBUG": "INFO",
            "HF_HUB_OFFLINE": "1", "RANK": str(rank), "FOO": "1", "SLURM_PROCID": None,
            "XDG_RUNTIME_DIR": None}  # fmt: skip


def test_local_ranks_get_the_shells_variables_but_not_its_sessions(tmp_path):
    # #45 item 3: `FOO=1 torchrun train.py` gives every rank FOO; the same rule on a cluster (test_multi_node)
    # No address and 2 nodes: simulated, with a program of the user's, every rank's output shown (formerly
    # also a run of examples/torchrun_script.py of its own, test_a_plain_torchrun_script_runs_locally_...)
    script = tmp_path / "probe.py"
    script.write_text(ENV_PROBE)
    env = drive.user_env(**SHELL_VARS)
    args = ("--device", "cpu", "--nodes", "2", "--gpus-per-node", "2", "--log-ranks", "all", "--runs-dir",
            str(tmp_path), str(script), str(tmp_path))  # fmt: skip
    p = drive.run(*args, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "simulating 2 node(s) x 2 CPU ranks on this machine" in p.stderr
    rows = re.findall(TOPOLOGY_ROW, p.stdout + p.stderr, flags=re.M)
    assert [(int(r), int(n), int(lr)) for r, n, lr in rows] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert all(f"[r{rank} n{rank // 2}] done" in p.stdout for rank in range(4)), p.stdout[-3000:]
    for rank in range(4):
        assert json.loads((tmp_path / f"env-{rank}.json").read_text()) == expected_env(rank)
    (run,) = (d for d in tmp_path.iterdir() if d.is_dir())
    forwarded = json.loads((run / "spec.json").read_text())["forwarded"]  # every name; the console, some
    assert forwarded["FOO"] == "1" and forwarded["MY_PASSWORD"] == "<redacted>"
    assert "SLURM_PROCID" not in forwarded and "XDG_RUNTIME_DIR" not in forwarded
    assert f"every rank gets {len(forwarded)} variables of this shell (values not shown): " in p.stderr
    assert "hunter2" not in (run / "spec.json").read_text() + (run / "env.json").read_text()
    assert "hunter2" not in p.stdout + p.stderr


FLOOD = """
import os, sys
rank = os.environ["RANK"]
for i in range(20000):
    print(f"rank {rank} line {i:05d} " + "x" * 40)
print(f"rank {rank} is done", file=sys.stderr)
"""


def test_a_full_disk_under_the_run_directory_is_said_and_fails_nothing(tmp_path):
    """#46 item 1: with the run directory on a full filesystem (a 1 MiB tmpfs, mounted in a mount
    namespace of the launch's own), the rank logs lost lines without a word and the good job exited 1
    with a traceback from writing summary.json. The console keeps every line, the loss is said, and
    the training's outcome stands."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a small filesystem needs root and util-linux's unshare")
    runs = tmp_path / "runs"
    runs.mkdir()
    script = tmp_path / "flood.py"
    script.write_text(FLOOD)
    shell = f'mount -t tmpfs -o size=1m none "{runs}" && exec "$@"'
    cmd = [sys.executable, str(drive.REPO / "main.py"), "--device", "cpu", "--gpus-per-node", "2",
           "--log-ranks", "all", "--runs-dir", str(runs), str(script)]  # fmt: skip
    p = subprocess.run(["unshare", "--mount", "sh", "-c", shell, "sh", *cmd], cwd=tmp_path,
                       env=drive.user_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    for rank in (0, 1):  # nothing lost on the console, each stream on its own
        assert len(re.findall(rf"^\[r{rank} n0\] rank {rank} line \d+ x+$", p.stdout, flags=re.M)) == 20000
        assert f"[r{rank} n0] rank {rank} is done" in p.stderr
    assert "Traceback" not in p.stderr and "all 2 ranks finished" in p.stderr, p.stderr[-3000:]
    said = p.stderr.splitlines()
    assert sum("cannot be written (No space left on device)" in ln for ln in said) == 1, p.stderr[-3000:]
    assert any(re.search(r"megaray: \d+ bytes of rank output were not written \(rank-\d\.log \d+", ln)
               for ln in said), p.stderr[-3000:]  # fmt: skip
