"""`megaray submit` and the job commands against a real `ray start --head` with its dashboard.

The head runs with token authentication on (its own token file), as Ray 2.60 clusters do by
default; the tests find the token through RAY_AUTH_TOKEN_PATH, as a user would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.cli import main

from . import drive
from .conftest import REPO, free_port
from .raycluster import start_cluster

SLEEPY = "import os, time\nprint(f\"rank {os.environ['RANK']} ready\", flush=True)\ntime.sleep(600)\n"
FAILING = (
    "import os, time\n"
    "if os.environ['RANK'] == '1':\n"
    "    raise ValueError('bad shard 17 on rank one')\n"
    "time.sleep(600)\n"
)


@pytest.fixture(scope="module")
def head():
    """A real head node on loopback ports of its own, with the dashboard, stopped at the end."""
    cluster = start_cluster(num_cpus=4, num_gpus=2)
    yield cluster
    cluster.stop()


@pytest.fixture
def token(head, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(head.token_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def workdir(tmp_path: Path, **files: str) -> Path:
    d = tmp_path / "wd"
    d.mkdir()
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_dry_run_job_streams_topology_and_succeeds(head, token, capsys):
    job = "sub-dry"
    secret = "--env DB_URL=postgres://me:s3cret-pw@db/x --env PLAIN=plain-s3cret"
    launch = f"--job-name {job} {secret} --nodes 1 --gpus-per-node 2 --dry-run steps=0"  # no training
    rc = main(f"submit --address {head.url} -- {launch}".split())
    out, err = capsys.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "s3cret" not in out + err  # --env values reach the ranks through the runtime env only
    assert "PLAIN=<not shown>" in out
    assert "topology (MASTER_ADDR=" in out and "dry run passed: 2 ranks" in out
    assert f"job {job} SUCCEEDED" in err
    assert head.status(job) == "SUCCEEDED"
    assert head.alive(job) == ([], [])
    # its run directory is on the head, outside the job's working directory (Ray's to unpack again and
    # delete): in the temp folder, where this test's head runs too
    import tempfile

    runs = Path(tempfile.gettempdir()) / f"megaray-runs-{os.getuid()}"
    found = re.search(
        rf"run directory: ({re.escape(str(runs / job))}(\.\d+)?)\n", out
    )  # .1: an earlier run's
    assert found and (Path(found.group(1)) / "topology.json").exists(), out[-3000:]

    # the job commands read it back
    assert main(["status", job, "--address", head.url]) == 0
    shown = capsys.readouterr().out
    assert "SUCCEEDED" in shown and "1x2 gpu" in shown and "--dry-run" in shown
    assert "--env DB_URL --env PLAIN" in shown and "s3cret" not in shown
    assert main(["logs", job, "--address", head.url]) == 0
    logs = capsys.readouterr().out
    assert "dry run passed" in logs and "s3cret" not in logs
    assert main(["list", "--address", head.url]) == 0
    assert job in capsys.readouterr().out


def test_failing_rank_fails_the_submit_with_the_root_cause(head, token, tmp_path, capsys):
    wd = workdir(tmp_path, **{"fail.py": FAILING})
    (wd / ".venv").mkdir()  # never uploaded
    argv = (
        f"submit --address {head.url} --working-dir {wd} -- --job-name sub-fail --nodes 1 --gpus-per-node 2"
    )
    rc = main([*argv.split(), "fail.py"])
    out, err = capsys.readouterr()
    assert rc == 1, out[-3000:] + err[-3000:]
    assert "ValueError: bad shard 17 on rank one" in out  # the traceback, from the job's logs
    assert "job sub-fail FAILED" in err and "root cause: rank 1 of 2 on " in err
    assert "bad shard 17" in err.split("root cause:")[1]
    assert head.status("sub-fail") == "FAILED"
    assert head.alive("sub-fail") == ([], [])


def test_sigint_stops_the_job_on_the_cluster(head, tmp_path):
    wd = workdir(tmp_path, **{"sleepy.py": SLEEPY})
    job = "sub-sigint"
    env = {k: v for k, v in head.env.items() if k != "RAY_AUTH_MODE"}  # megaray finds the token itself
    cmd = [sys.executable, "-m", "launcher", "submit", "--address", head.url, "--working-dir", str(wd), "--"]
    cmd += f"--job-name {job} --nodes 1 --gpus-per-node 2 sleepy.py".split()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    deadline = time.monotonic() + 120
    while not any("[r0 n0] rank 0 ready" in ln for ln in seen):  # the console shows rank 0
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, "".join(seen)[-3000:]
        seen.append(line)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, "".join(seen)[-2000:] + rest
    assert f"stopping job {job} on the cluster" in rest and "STOPPED" in rest
    assert head.status(job) == "STOPPED"
    assert head.alive(job) == ([], [])


def test_no_wait_returns_the_id_and_stop_ends_the_job(head, token, tmp_path, capsys):
    wd = workdir(tmp_path, **{"sleepy.py": SLEEPY})
    job = "sub-nowait"
    argv = f"submit --no-wait --address {head.url} --working-dir {wd} -- --job-name {job} --device cpu "
    assert main([*argv.split(), "sleepy.py"]) == 0
    assert capsys.readouterr().out.strip() == job
    deadline = time.monotonic() + 60
    while head.status(job) != "RUNNING":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert main(["stop", job, "--address", head.url]) == 0
    assert head.status(job) == "STOPPED"
    assert head.alive(job) == ([], [])


@pytest.mark.parametrize(
    "launch, message",
    [
        ("--nodes 0 --dry-run", "--nodes must be at least 1, got 0"),
        ("--nodes 1 train.py", "add --working-dir"),
        ("--address 127.0.0.1:6379 --dry-run", "drop --address"),
        ("--recipe no_such_recipe", "unknown recipe 'no_such_recipe'"),
    ],
)
def test_bad_launch_arguments_create_no_job(head, token, capsys, launch, message):
    before = head.jobs()
    assert main(["submit", "--address", head.url, "--", *launch.split()]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert head.jobs() == before


def test_token_problems_are_explained(head, tmp_path):
    # Fresh processes, as users run it: Ray caches the token mode and the token once per process.
    def listing(*args: str, **env: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "launcher", *(args or ("list", "--address", head.url))]
        env = drive.user_env(drop=("RAY_AUTH",), **env)
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    wrong = listing(RAY_AUTH_TOKEN="not-the-token")
    assert wrong.returncode == 2 and "rejected the token sent" in wrong.stderr
    missing = listing(HOME=str(tmp_path), RAY_AUTH_TOKEN_PATH=str(tmp_path / "missing"))
    assert missing.returncode == 2 and "no token was found here" in missing.stderr
    right = listing(HOME=str(tmp_path), RAY_AUTH_TOKEN_PATH=str(head.token_path))
    assert right.returncode == 0 and "sub-dry" in right.stdout
    # the GCS's address, with the token and no RAY_AUTH_MODE: Ray's job client asks the GCS for the
    # dashboard first, which rejected it; and the listing's own connection is not a job
    token = head.token_path.read_text().strip()
    by_gcs = listing("list", HOME=str(tmp_path), RAY_AUTH_TOKEN=token, RAY_ADDRESS=head.gcs)
    assert by_gcs.returncode == 0 and "sub-dry" in by_gcs.stdout, by_gcs.stderr
    assert "main.py" not in by_gcs.stdout and "-m launcher" not in by_gcs.stdout
    status = listing("status", "sub-dry", HOME=str(tmp_path), RAY_AUTH_TOKEN=token, RAY_ADDRESS=head.gcs)
    assert status.returncode == 0, status.stderr


def test_unknown_job_and_unreachable_dashboard(head, token, capsys):
    assert main(["status", "no-such-job", "--address", head.url]) == 2
    assert "no job no-such-job" in capsys.readouterr().err
    assert main(["list", "--address", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "cannot reach a Ray dashboard" in capsys.readouterr().err


def test_a_head_whose_python_lacks_megaray_ends_the_job_in_one_line(head, token, tmp_path, capsys):
    # The job's `python` is the first on the PATH the head has: here, the interpreter outside this venv.
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(Path(sys.base_prefix) / "bin" / "python3")
    runtime_env = json.dumps({"env_vars": {"PATH": f"{bare}:/usr/bin:/bin"}})
    argv = ["submit", "--address", head.url, "--runtime-env-json", runtime_env, "--", "--job-name", "sub-np",
            "--dry-run"]  # fmt: skip
    assert main(argv) == 2  # bad setup, as any other: not a rank's failure
    out, err = capsys.readouterr()
    line = next(ln for ln in (out + err).splitlines() if ln.startswith("megaray: error: the job runs /"))
    assert (
        f"the job runs {bare / 'python'}, which cannot import megaray" in line and "activate the env" in line
    )
    assert "Traceback" not in out
