"""A Ray job submission as data: its arguments parsed (the launch among them, checked here first so
that bad input never creates a job), what is uploaded, the entrypoint and metadata, the token to
send, and how the job's outcome reads back from its logs and info. Pure: tested without a cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

from ..core.args import ArgumentParser
from ..core.errors import UsageError
from ..core.launch_args import build_parser as build_launch_parser
from ..core.launch_args import spec_from_args
from ..core.raytoken import auth_disabled, find_token
from ..core.spec import LaunchSpec
from ..core.topology import format_table
from ..core.versions import megaray_version, python_version
from ..driver.lifecycle.registry import runner_for

log = logging.getLogger("megaray")


# Never worth shipping to the cluster: version control, environments, caches, training outputs and
# weights. Patterns use .gitignore syntax relative to the working directory (Ray's `excludes`).
DEFAULT_EXCLUDES = (
    ".git", ".hg", ".svn", ".venv", "venv", ".env", "__pycache__", "*.pyc", ".pytest_cache",
    ".ruff_cache", ".mypy_cache", ".ipynb_checkpoints", ".tox", "node_modules",
    "checkpoints", "checkpoint", "ckpt", "runs", "wandb", "mlruns", "nemo_experiments", "outputs",
    "*.pt", "*.pth", "*.ckpt", "*.safetensors", "*.distcp", "*.gguf",
)  # fmt: skip
LARGE_FILE_BYTES = 50 * 1024 * 1024
STOP_WAIT_S = 60.0


@dataclass(frozen=True)
class SubmitSpec:
    """A launch to run as a Ray job; built by `submit_spec_from_args`, used unchanged."""

    launch: LaunchSpec
    launch_argv: tuple[str, ...]
    address: str | None = None  # None: RAY_API_SERVER_ADDRESS, RAY_ADDRESS, then Ray's default
    working_dir: str | None = None
    runtime_env: Mapping[str, Any] = field(default_factory=dict)
    wait: bool = True

    @property
    def submission_id(self) -> str:
        return self.launch.job_name


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="megaray", description="Run a launch as a Ray job, and follow or stop it.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    addr = "Ray dashboard address, e.g. http://HEAD:8265 (default: RAY_API_SERVER_ADDRESS, else RAY_ADDRESS)"

    s = sub.add_parser(
        "submit",
        help="submit a launch as a Ray job and stream its logs",
        usage="megaray submit [--address URL] [--working-dir DIR] [--runtime-env-json JSON] [--no-wait] "
        "-- <launch arguments>",
    )
    s.add_argument("--address", help=addr)
    s.add_argument(
        "--working-dir", help="folder to upload; the job runs in it (caches, venvs, .git left out)"
    )
    s.add_argument("--runtime-env-json", help="Ray runtime_env as JSON (pip, env_vars, py_modules, ...)")
    s.add_argument("--no-wait", action="store_true", help="print the job id and return")

    for name, what in (("status", "show a job's status"), ("stop", "stop a job and wait until it ended")):
        c = sub.add_parser(name, help=what)
        c.add_argument("job", help="the job's id, as `megaray submit` and `megaray list` print it")
        c.add_argument("--address", help=addr)
    c = sub.add_parser("logs", help="print a job's logs")
    c.add_argument("job", help="the job's id, as `megaray submit` and `megaray list` print it")
    c.add_argument("--address", help=addr)
    c.add_argument(
        "-f", "--follow", action="store_true", help="stream until the job ends; exit with its status"
    )
    c = sub.add_parser("list", help="list the cluster's jobs")
    c.add_argument("--address", help=addr)
    return p


def submit_spec_from_args(
    argv: list[str], environ: Mapping[str, str] | None = None, cwd: str | None = None
) -> SubmitSpec:
    """Parse `submit` and check the launch arguments here, before anything reaches the cluster."""
    environ = os.environ if environ is None else environ
    own = argv[: argv.index("--")] if "--" in argv else argv
    if "-h" in own or "--help" in own:
        build_parser().parse_args(["submit", "--help"])  # prints the help and exits 0
    if "--" not in argv:
        raise UsageError(
            "put the launch arguments after --, e.g. megaray submit --working-dir . -- --nodes 2 "
            "--gpus-per-node 8 train.py"
        )
    cut = argv.index("--")
    args = build_parser().parse_args(["submit", *argv[:cut]])
    launch_argv = argv[cut + 1 :]
    runtime_env = _parse_runtime_env(args.runtime_env_json)
    working_dir = args.working_dir
    if working_dir and "working_dir" in runtime_env:
        raise UsageError(
            "the working directory is given twice: use --working-dir or runtime_env's working_dir"
        )
    working_dir = working_dir or runtime_env.pop("working_dir", None)
    local_dir = working_dir if working_dir and "://" not in working_dir else None
    if local_dir and not Path(local_dir).is_dir():
        raise UsageError(f"--working-dir {working_dir} is not a folder")
    # Inside the job RAY_ADDRESS names the cluster it runs on: the launch must not name another.
    here = {k: v for k, v in environ.items() if k != "RAY_ADDRESS"}  # `--env KEY` forwards from here
    launch = spec_from_args(
        launch_argv, environ=here, cwd=str(Path(local_dir).resolve()) if local_dir else cwd
    )
    if launch.address:
        raise UsageError("a submitted launch runs on the cluster it is submitted to: drop --address after --")
    _check_target(launch, local_dir, bool(working_dir))
    launch_argv, values = env_out_of_argv(launch_argv, dict(launch.env))
    theirs = runtime_env.setdefault("env_vars", {})
    clash = sorted(k for k, v in values.items() if theirs.get(k, v) != v)
    if clash:
        raise UsageError(f"{', '.join(clash)} is given both in --env and in --runtime-env-json's env_vars")
    theirs.update(values)
    if not theirs:
        del runtime_env["env_vars"]
    if local_dir:
        runtime_env["working_dir"] = str(Path(local_dir).resolve())
        runtime_env["excludes"] = package_excludes(Path(local_dir), runtime_env.get("excludes", []))
    elif working_dir:
        runtime_env["working_dir"] = working_dir
    return SubmitSpec(
        launch=launch,
        launch_argv=tuple(launch_argv),
        address=args.address or environ.get("RAY_API_SERVER_ADDRESS") or environ.get("RAY_ADDRESS") or None,
        working_dir=working_dir,
        runtime_env=runtime_env,
        wait=not args.no_wait,
    )


def env_out_of_argv(argv: list[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The launch arguments with every `--env KEY=VALUE` of megaray's own options turned into
    `--env KEY`, and those values, for the job's runtime env: a value on the job's command line would
    show in its entrypoint, its metadata, `megaray status` and the head's process list. Arguments for
    the program (after the script or module) are left alone."""
    takes_value = {
        flag: action.nargs is None
        for action in build_launch_parser()._actions
        for flag in action.option_strings
    }
    out: list[str] = []
    values: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, eq, inline = token.partition("=")
        if token == "--" or not token.startswith("-") or flag not in takes_value:
            out += argv[i:]  # the program and its arguments
            break
        value = inline if eq else (argv[i + 1] if takes_value[flag] and i + 1 < len(argv) else None)
        if flag == "--env" and value is not None:
            key = value.partition("=")[0]
            if key in env:
                values[key] = env[key]
            out += [flag, key]
        else:
            out += (
                [token] if eq or not takes_value[flag] else [token, *([value] if value is not None else [])]
            )
        i += 1 if eq or not takes_value[flag] else 2
    return out, values


def _parse_runtime_env(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        env = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--runtime-env-json is not valid JSON: {e}") from None
    if not isinstance(env, dict):
        raise UsageError('--runtime-env-json must be a JSON object such as \'{"pip": ["pkg"]}\'')
    return env


def _check_target(launch: LaunchSpec, local_dir: str | None, has_working_dir: bool) -> None:
    """What the target's runner can tell from the uploaded folder (core/runner.py `check_submitted`)."""
    runner_for(launch.target).check_submitted(launch.target, local_dir, has_working_dir)


def package_excludes(root: Path, user_excludes: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Ray `excludes` for uploading `root`: the defaults, virtualenvs under any name, files over 50 MiB.

    Large files are named in a warning: they are usually weights or data that belong on shared
    storage, and Ray refuses a package over its 512 MiB message limit anyway.
    """
    excludes = [*DEFAULT_EXCLUDES, *user_excludes]
    skip_names = {e for e in DEFAULT_EXCLUDES if "*" not in e}
    large: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for d in list(dirnames):
            if d in skip_names:
                dirnames.remove(d)
            elif (here / d / "pyvenv.cfg").is_file():  # a virtualenv, whatever its name
                excludes.append("/" + (here / d).relative_to(root).as_posix())
                dirnames.remove(d)
        for f in filenames:
            try:
                size = (here / f).stat().st_size
            except OSError:
                continue
            if size > LARGE_FILE_BYTES:
                rel = (here / f).relative_to(root).as_posix()
                large.append((rel, size))
                excludes.append("/" + rel)
    if large:
        shown = ", ".join(f"{p} ({s / 2**20:.0f} MiB)" for p, s in sorted(large))
        log.warning(
            "not uploading files over %d MiB: %s; put them on shared storage",
            LARGE_FILE_BYTES // 2**20,
            shown,
        )
    return excludes


# What the job runs first on the head: the job's `python` is whatever `ray start --head` found first on
# its PATH (a head started from a venv that was not activated runs the system's). If it cannot import
# megaray, or has another Ray or Python than the client, the job ends at once in one line saying which
# interpreter it found and how to fix it (ENV_FIX), instead of a ModuleNotFoundError from deep inside.
ENV_FIX = (
    "activate the environment that has megaray (and the same Ray and Python) before `ray start` on the "
    "head, or pass --runtime-env-json with a py_executable or pip that has it"
)
BOOTSTRAP = f"""import sys
try:
    from launcher.cli.main import job_driver
except ImportError as e:
    print(f'megaray: error: the job runs {{sys.executable}}, which cannot import megaray ({{e}}): '
          '{ENV_FIX}', file=sys.stderr)
    sys.exit(2)
sys.exit(job_driver(WANT_RAY, WANT_PY))"""


def job_entrypoint(spec: SubmitSpec) -> str:
    """The shell command the job runs on the head: this launch, named after the submission, behind
    the check of the job's interpreter (BOOTSTRAP) against this one's Ray and Python."""
    argv = list(spec.launch_argv)
    if "--job-name" not in argv and not any(a.startswith("--job-name=") for a in argv):
        argv = ["--job-name", spec.submission_id, *argv]
    python_minor = python_version().rsplit(".", 1)[0]
    code = BOOTSTRAP.replace("WANT_RAY", repr(version("ray"))).replace("WANT_PY", repr(python_minor))
    return shlex.join(["python", "-c", code, *argv])


def job_metadata(spec: SubmitSpec) -> dict[str, str]:
    """What was asked, readable with `megaray status` and the dashboard (values must be strings)."""
    launch = spec.launch
    return {
        "megaray.version": megaray_version(),
        "megaray.layout": f"{launch.nodes}x{launch.gpus_per_node} {launch.device}",
        "megaray.target": runner_for(launch.target).describe(launch.target),
        "megaray.argv": json.dumps(list(spec.launch_argv)),
    }


def auth_headers(environ: Mapping[str, str], home: Path | None = None) -> dict[str, str]:
    """The bearer token for a cluster with Ray's token authentication, found where Ray looks for it.

    Ray's own job client sends it only when RAY_AUTH_MODE=token is set; `ray start` turns token
    mode on whenever a token is present, so do the same (core/raytoken.py: Ray's order).
    RAY_AUTH_MODE=disabled sends none.
    """
    if auth_disabled(environ):
        return {}
    found = find_token(environ, home or Path.home())
    return {"Authorization": f"Bearer {found.token}"} if found else {}


def root_cause(logs: str) -> str | None:
    """The one line that says why a job failed, from its logs."""
    lines = logs.splitlines()
    if "Root cause (first failure):" in lines:
        i = lines.index("Root cause (first failure):")
        fields = {}
        for ln in lines[i + 1 : i + 12]:
            m = re.match(r"\s+(rank|node|what)\s+: (.*)", ln)
            if m:
                fields[m.group(1)] = m.group(2)
        if fields:
            return f"rank {fields.get('rank', '?')} on {fields.get('node', '?')}: {fields.get('what', '?')}"
    for ln in reversed(lines):
        if ln.startswith("megaray: error: "):
            return ln.removeprefix("megaray: error: ")
    for ln in reversed(lines):
        if ln.strip() and not ln.startswith("megaray: "):
            return ln.strip()
    return None


def _when(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def format_status(info) -> str:
    meta = info.metadata or {}
    rows = [
        ("job", info.submission_id or info.job_id),
        ("status", info.status.value),
        ("started", _when(info.start_time)),
        ("ended", _when(info.end_time)),
        ("exit code", "-" if getattr(info, "driver_exit_code", None) is None else str(info.driver_exit_code)),
        ("layout", meta.get("megaray.layout", "-")),
        ("target", meta.get("megaray.target", "-")),
        (
            "launch",
            "megaray " + " ".join(json.loads(meta.get("megaray.argv", "[]"))) if meta else info.entrypoint,
        ),
        ("message", " ".join((info.message or "-").split())[:300]),
    ]
    return "\n".join(f"{k:<11} {v}" for k, v in rows)


def format_jobs(jobs: list) -> str:
    rows = [("JOB", "STATUS", "STARTED", "LAYOUT", "TARGET")]
    for j in jobs:
        meta = j.metadata or {}
        rows.append(
            (
                j.submission_id or j.job_id or "-",
                j.status.value,
                _when(j.start_time),
                meta.get("megaray.layout", "-"),
                meta.get("megaray.target", (j.entrypoint or "")[:60]),
            )
        )
    return format_table(rows)
