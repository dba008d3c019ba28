"""Tier 1 for `megaray submit`: what is submitted, decided without a cluster."""

from __future__ import annotations

import json
import shlex

import pytest

from launcher.cli.jobspec import auth_headers, job_entrypoint, job_metadata, package_excludes, root_cause
from launcher.cli.jobspec import submit_spec_from_args as parse
from launcher.core.errors import RankFailedError, RankFailure, UsageError


def test_the_job_runs_the_same_launch_named_after_the_submission(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    spec = parse(
        ["--working-dir", str(tmp_path), "--", "--nodes", "2", "train.py", "--lr", "1e-4"], environ={}
    )
    cmd = shlex.split(job_entrypoint(spec))
    assert (
        cmd[:2] == ["python", "-c"] and "from launcher.cli.main import job_driver" in cmd[2]
    )  # the bootstrap
    assert cmd[3:] == ["--job-name", spec.submission_id, "--nodes", "2", "train.py", "--lr", "1e-4"]
    assert spec.runtime_env["working_dir"] == str(tmp_path.resolve())
    meta = job_metadata(spec)
    assert meta["megaray.layout"] == "2x1 gpu" and meta["megaray.target"] == "train.py --lr 1e-4"
    assert all(isinstance(v, str) for v in meta.values())


def test_env_values_travel_in_the_runtime_env_never_on_the_command_line(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    argv = ["--working-dir", str(tmp_path), "--", "--env", "HF_TOKEN=hf_s3cret", "--env=DB=postgres://u:pw@h/db",
            "--env", "FROM_SHELL", "train.py", "--env", "X=program-arg"]  # fmt: skip
    spec = parse(argv, environ={"FROM_SHELL": "shell-value", "RAY_ADDRESS": "elsewhere:6379"})
    shown = job_entrypoint(spec) + json.dumps(job_metadata(spec))
    for value in ("hf_s3cret", "pw@h", "shell-value"):
        assert value not in shown
    assert shlex.split(job_entrypoint(spec))[-8:] == [
        "--env", "HF_TOKEN", "--env", "DB", "--env", "FROM_SHELL", "train.py", "--env", "X=program-arg",
    ][-8:]  # fmt: skip
    assert spec.runtime_env["env_vars"] == {
        "HF_TOKEN": "hf_s3cret", "DB": "postgres://u:pw@h/db", "FROM_SHELL": "shell-value",
    }  # fmt: skip
    with pytest.raises(UsageError, match="HF_TOKEN is given both"):
        parse(
            [
                "--runtime-env-json",
                '{"env_vars": {"HF_TOKEN": "other"}}',
                "--",
                "--env",
                "HF_TOKEN=x",
                "--dry-run",
            ]
        )
    with pytest.raises(UsageError, match="--env NOT_SET forwards this shell's NOT_SET, which is not set"):
        parse(["--", "--env", "NOT_SET", "--dry-run"], environ={})


def test_a_given_job_name_is_the_submission_id():
    spec = parse(["--", "--job-name", "exp-7", "--dry-run"], environ={})
    assert spec.submission_id == "exp-7"
    assert shlex.split(job_entrypoint(spec)).count("--job-name") == 1


def test_address_comes_from_the_flag_then_the_environment():
    assert parse(["--", "--dry-run"], environ={"RAY_ADDRESS": "http://a:8265"}).address == "http://a:8265"
    env = {"RAY_ADDRESS": "http://a:8265", "RAY_API_SERVER_ADDRESS": "http://b:8265"}
    assert parse(["--", "--dry-run"], environ=env).address == "http://b:8265"
    assert parse(["--address", "http://c:8265", "--", "--dry-run"], environ=env).address == "http://c:8265"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dry-run"], "put the launch arguments after --"),
        (["--", "--dry-run", "--address", "h:1"], "drop --address"),
        (["--", "train.py"], "add --working-dir"),
        (["--working-dir", "/no/such/dir", "--", "--dry-run"], "is not a folder"),
        (["--runtime-env-json", "[1]", "--", "--dry-run"], "must be a JSON object"),
        (["--runtime-env-json", "{x", "--", "--dry-run"], "not valid JSON"),
        (
            ["--working-dir", ".", "--runtime-env-json", '{"working_dir": "."}', "--", "--dry-run"],
            "given twice",
        ),
        (["--", "--entrypoint", "launcher.megatron.dryrun:nope"], "defines no nope"),
    ],
)
def test_bad_submissions_are_refused_here(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(argv, environ={})


def test_a_script_missing_from_the_working_dir_is_refused(tmp_path):
    with pytest.raises(UsageError, match=r"script train\.py not found"):
        parse(["--working-dir", str(tmp_path), "--", "train.py"], environ={})


def test_uploads_leave_out_venvs_caches_and_large_files(tmp_path):
    (tmp_path / "myenv").mkdir()
    (tmp_path / "myenv" / "pyvenv.cfg").write_text("home = /usr\n")
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "shard.bin", "wb") as f:
        f.truncate(60 * 2**20)  # sparse: 60 MiB without writing them
    (tmp_path / "data" / "small.txt").write_text("x")
    excludes = package_excludes(tmp_path, ["extra/"])
    assert {".git", ".venv", "__pycache__", "checkpoints", "*.safetensors", "extra/"} <= set(excludes)
    assert "/myenv" in excludes and "/data/shard.bin" in excludes
    assert not any("small.txt" in e for e in excludes)


def test_the_token_is_found_where_ray_looks(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("from-home\n")
    (tmp_path / "tok").write_text("from-path")
    bearer = lambda t: {"Authorization": f"Bearer {t}"}  # noqa: E731
    assert auth_headers({}, home) == bearer("from-home")
    assert auth_headers({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "tok")}, home) == bearer("from-path")
    assert auth_headers({"RAY_AUTH_TOKEN": "env", "RAY_AUTH_TOKEN_PATH": "x"}, home) == bearer("env")
    assert auth_headers({"RAY_AUTH_MODE": "disabled"}, home) == {}
    assert auth_headers({}, tmp_path / "nobody") == {}


def test_root_cause_from_a_failed_launchs_logs():
    failure = RankFailure(3, "10.0.0.2", "node-b", "1", "exception", "ValueError: bad batch", "Traceback...")
    logs = "rank output\n" + RankFailedError([failure], 8).report() + "\n"
    assert root_cause(logs) == "rank 3 of 8 on 10.0.0.2 (node-b): ValueError: bad batch"
    assert root_cause("megaray: job x\nmegaray: error: the cluster has 2 GPUs, asked 4\n") == (
        "the cluster has 2 GPUs, asked 4"
    )
    assert root_cause("Traceback (most recent call last):\nModuleNotFoundError: launcher\n") == (
        "ModuleNotFoundError: launcher"
    )
