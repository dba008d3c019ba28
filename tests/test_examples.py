"""The examples users copy: the Slurm script (run here as a one-node allocation on loopback) and the
KubeRay RayJob (its shape; no Kubernetes API server is available offline to validate it)."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
import yaml

from launcher.core.launch_args import spec_from_args

from . import drive
from .conftest import REPO, free_port

SBATCH = REPO / "examples" / "slurm" / "ray.sbatch"
RAYJOB = REPO / "examples" / "kuberay" / "rayjob.yaml"


def test_the_sbatch_script_parses_and_passes_shellcheck():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    shellcheck = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable), "shellcheck")
    if not os.path.exists(shellcheck):
        pytest.skip("shellcheck is not installed (it comes with the test extra)")
    done = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.mark.slow
def test_the_sbatch_script_brings_up_ray_runs_a_dry_run_and_stops_ray(tmp_path):
    port, dash = free_port(), free_port()
    env = {
        **drive.user_env(drop=("SLURM_",)),
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        "PYTHON": sys.executable,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_CPUS_ON_NODE": "4",
        "RAY_PORT": str(port),
        "DASHBOARD_PORT": str(dash),
        "DASHBOARD_HOST": "127.0.0.1",
        "RAY_TEMP_DIR": tempfile.mkdtemp(prefix="mr-", dir="/tmp"),
        "RAY_LOG_DIR": str(tmp_path / "logs"),
    }
    done = subprocess.run(
        ["bash", str(SBATCH), "--gpus-per-node", "2", "--runs-dir", str(tmp_path / "runs"), "--dry-run",
         "steps=0"],  # the rendezvous check alone: what the script does is the subject, not training
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert f"Ray cluster ready at 127.0.0.1:{port}" in out
    assert "dry run passed: 2 ranks on 1 node(s)" in out
    assert "stopping Ray on 1 node(s)" in out
    with pytest.raises(OSError):  # the head is gone: nothing listens on its GCS port any more
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"--gcs_server_port={port}" not in ps and str(env["RAY_TEMP_DIR"]) not in ps


def test_the_sbatch_script_refuses_to_run_outside_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "not inside a Slurm allocation" in done.stderr


def test_the_rayjob_runs_a_valid_megaray_launch_on_a_gpu_cluster():
    job = yaml.safe_load(RAYJOB.read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["python", "-m", "launcher"]
    launch = spec_from_args(argv[3:], environ={})  # the entrypoint is a launch megaray accepts
    workers = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert sum(w["replicas"] for w in workers) == launch.nodes
    for w in workers:
        limits = w["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == launch.gpus_per_node
    head = spec["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"  # ranks never land on the head
    assert spec["rayClusterSpec"]["rayVersion"].startswith("2.60")
    assert spec["shutdownAfterJobFinishes"] is True and spec["backoffLimit"] == 0
