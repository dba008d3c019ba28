"""A rank is a torchrun worker at the process level: one probe program (fixtures/process/probe.py),
unchanged, run under torchrun and under megaray, sees the same process — start-up variables in
effect, niceness, signal dispositions and masks, what SIGINT does to it and to its children, stdin,
sys.path, breakpoint() — and a process that dies on its way out fails the launch under both. The
pools of `megaray up` run the same probe in tests/test_up.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from . import drive
from .conftest import REPO

PROBE = Path(__file__).resolve().parent / "fixtures" / "process" / "probe.py"
START_UP = {"PYTHONHASHSEED": "0", "PYTHONDEVMODE": "1", "PYTHONWARNINGS": "ignore::ResourceWarning"}
# The shell both launchers start from: the basics, a secret, a custom CA, a library's variable, and a
# thread count (numpy's BLAS must take it under both).
SHELL = {"MY_PASSWORD": "hunter2", "AWS_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt",
         "NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "2"}  # fmt: skip

# What the probe sees differently, on purpose (docs/reference/environment.md, "The process", says
# why); any other difference fails the test. The environment: megaray adds the node's GPU list,
# NODE_RANK, the network profile's interface names and its Ray worker's own variables; the shell's
# reach it as under torchrun (a secret too), less what describes the driver's machine and session
# (docs/reference/environment.md, "What reaches a rank"), which the rank's node has of its own;
# torchrun's agent's own setting is not there. Modules: a Ray worker has loaded Ray and what Ray
# imports (pyarrow, numpy and pydantic where a rank's process imports one: Ray's serializers for
# their types are registered then, rank/serialization.py), and megaray's own package with wrapt.
ADDED_NAMES = {"CUDA_VISIBLE_DEVICES", "NODE_RANK", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "SPT_NOENV"}
ADDED_PREFIXES = ("RAY_",)
DROPPED_NAMES = {"TORCHELASTIC_SIGNALS_TO_HANDLE", "SHLVL"}  # the login shell's depth: a session's
RAY_WORKER_MODULES = {
    "ray", "google", "msgpack", "psutil", "colorama", "yaml", "requests", "urllib3", "idna", "certifi",
    "charset_normalizer", "filelock", "packaging", "jsonschema", "jsonschema_specifications", "referencing",
    "rpds", "attr", "attrs", "typing_extensions", "tqdm", "wcwidth", "pydantic", "pydantic_core",
    "annotated_types", "typing_inspection", "pyarrow", "numpy", "cython_runtime",
}  # fmt: skip
RAY_WORKER_MODULE_PREFIXES = ("_cython_", "_sysconfigdata_")


def unexpected_names(torchrun: list[str], megaray: list[str]) -> tuple[set[str], set[str]]:
    """(names megaray added beyond ADDED_*, names it dropped beyond DROPPED_NAMES)."""
    added = {
        n for n in set(megaray) - set(torchrun) if n not in ADDED_NAMES and not n.startswith(ADDED_PREFIXES)
    }
    return added, set(torchrun) - set(megaray) - DROPPED_NAMES


def unexpected_modules(torchrun: list[str], megaray: list[str]) -> tuple[set[str], set[str]]:
    """(modules loaded before the program under megaray that are not Ray's or megaray's, and modules
    loaded under torchrun but not under megaray)."""
    extra = set(megaray) - set(torchrun) - RAY_WORKER_MODULES - {"launcher", "wrapt"}
    return {m for m in extra if not m.startswith(RAY_WORKER_MODULE_PREFIXES)}, set(torchrun) - set(megaray)


COMPARED_APART = {"env_names": unexpected_names, "preloaded": unexpected_modules}


def base_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return drive.user_env(drop=("RAY_AUTH", "PYTHON"), HOME=str(home))


def probe_dir(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A working folder holding the probe, and an empty folder for what it writes."""
    work = tmp_path / f"work-{name}"
    work.mkdir()
    shutil.copy(PROBE, work / "probe.py")
    out = tmp_path / f"out-{name}"
    out.mkdir()
    return work, out


def seen(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"process-{r}.json").read_text()) for r in range(world)]


def under_torchrun(
    tmp_path: Path, script: str, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        script,
        *args,
    ]
    return subprocess.run(cmd, cwd=Path(script).parent, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def under_megaray(tmp_path: Path, script: str, *args: str, env: dict[str, str], extra: tuple[str, ...] = ()):
    args = (
        "--device",
        "cpu",
        "--gpus-per-node",
        "2",
        "--runs-dir",
        str(tmp_path / "runs"),
        *extra,
        script,
        *args,
    )
    return drive.run(*args, env=env, cwd=Path(script).parent)


def under_both(tmp_path: Path, name: str, program: str):
    """The program, unchanged, under torchrun and then under megaray: (torchrun's, megaray's)."""
    env = base_env(tmp_path)
    script = tmp_path / name
    script.write_text(program)
    return under_torchrun(tmp_path, str(script), env=env), under_megaray(tmp_path, str(script), env=env)


def comparable(views: list[dict], work: Path) -> list[dict]:
    """The probe's views with the one thing that differs between two runs, the folder, made equal."""
    text = json.dumps(views).replace(str(work), "<work>")
    return json.loads(text)


@contextlib.contextmanager
def as_a_script_in_the_background():
    """What a shell script's `command &` starts a command with: SIGINT and SIGQUIT ignored (bash does
    so without job control), which its children inherit; a suite run from a script in the background
    saw megaray's ranks keep SIGQUIT ignored where torchrun's workers had it at its default."""
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGQUIT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_rank_sees_the_process_torchrun_gives_it(tmp_path):
    env = base_env(tmp_path)
    basics = {k: env[k] for k in ("PATH", "HOME", "TMPDIR", "LANG") if k in env}
    env = {**basics, "PWD": os.getcwd(), "SHLVL": "1", **SHELL}  # as a shell exports them
    work_t, out_t = probe_dir(tmp_path, "torchrun")
    env.update(START_UP)  # exported in the shell, as `PYTHONHASHSEED=0 torchrun ...` (#45 item 3)
    with as_a_script_in_the_background():
        done = under_torchrun(tmp_path, str(work_t / "probe.py"), str(out_t), env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        work_m, out_m = probe_dir(tmp_path, "megaray")
        done = under_megaray(tmp_path, str(work_m / "probe.py"), str(out_m), env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    torchrun, megaray = comparable(seen(out_t, 2), work_t), comparable(seen(out_m, 2), work_m)
    # the start-up variables took effect: hash randomisation off, the same hash on every rank
    assert torchrun[0]["hash_randomization"] == 0 and torchrun[0]["dev_mode"] is True
    assert len({v["hash"] for v in torchrun + megaray}) == 1
    for rank, (t, m) in enumerate(zip(torchrun, megaray, strict=True)):
        differ = {k: (t[k], m.get(k)) for k in t if t[k] != m.get(k) and k not in COMPARED_APART}
        assert not differ, f"rank {rank} sees under megaray what it does not under torchrun: {differ}"
        for key, unexpected in COMPARED_APART.items():
            assert unexpected(t[key], m[key]) == (set(), set()), (rank, key, unexpected(t[key], m[key]))
    # what the probe found, spelled out: a torchrun worker's process
    m = megaray[0]
    assert m["nice"] == 0 and m["sig_blocked"] == "0000000000000000" and m["keyboard_interrupt"] == "raised"
    assert m["child_sigint_exit"] == -2 and m["stdin"] == "EOFError" and m["breakpointhook"] is None
    assert m["sys_path"][0] == "<work>" and not any("/ray/" in p for p in m["sys_path"])
    assert m["blas_threads"] == [["openblas", 2]] and {"AWS_CA_BUNDLE", "MY_PASSWORD"} <= set(m["env_names"])
    assert not {"torch", "numpy", "pyarrow", "pydantic"} & set(m["preloaded"]), m["preloaded"]  # as torchrun


ABORT_ON_EXIT = """
import atexit, os, sys
print(f"rank {os.environ['RANK']} returns", flush=True)
if os.environ["RANK"] == "1":
    atexit.register(os.abort)  # as a native library's teardown can
"""


def test_a_process_that_dies_on_its_way_out_fails_the_launch(tmp_path):
    torchrun, done = under_both(tmp_path, "abort_on_exit.py", ABORT_ON_EXIT)
    assert torchrun.returncode == 1 and "SIGABRT" in torchrun.stderr, torchrun.stderr[-3000:]
    report = done.stderr
    assert done.returncode == 1, report[-3000:]
    assert "all 2 ranks finished" not in report
    assert "rank      : 1 of 2" in report and "after the program returned" in report, report[-3000:]
    assert "killed by SIGABRT" in report and "Fatal Python error: Aborted" in report


RECORDS = """
import os
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("bad batch at step 3")


main()
"""


def test_a_recorded_error_is_reported_as_torchrun_reports_it(tmp_path):
    """torch elastic's @record writes TORCHELASTIC_ERROR_FILE; the report names what torchrun's does
    (rank and local rank, pid, exit code, time, the error file) with the traceback as recorded, and
    the rank's log keeps the traceback."""
    torchrun, done = under_both(tmp_path, "records.py", RECORDS)
    assert torchrun.returncode == 1 and "error_file: " in torchrun.stderr, torchrun.stderr[-3000:]
    report = done.stderr[done.stderr.index("Root cause") :]
    assert done.returncode == 1, done.stderr[-3000:]
    for line in ("rank      : 1 of 2", "what      : ValueError: bad batch at step 3", "local rank: 1",
                 "exit code : 1", "time      : ", "pid       : "):  # fmt: skip
        assert f"  {line}" in report, report
    error_file = re.search(r"error file: (\S+) \(on ", report).group(1)
    recorded = json.loads(Path(error_file).read_text())["message"]
    assert recorded["message"] == "ValueError: bad batch at step 3"
    assert "in wrapper" in report and "<frozen runpy>" not in report  # @record's frame: as recorded
    (run,) = (tmp_path / "runs").iterdir()
    assert 'raise ValueError("bad batch at step 3")' in (run / "rank-1.log").read_text()


CLOSES_OUTPUT = """
import os, sys
# one string a line: with PYTHONUNBUFFERED set, print() writes each of its arguments apart, and two
# ranks sharing torchrun's stdout interleave them ("rankrank 1 ...")
print(f"rank {os.environ['RANK']} closes its output", flush=True)
print(f"rank {os.environ['RANK']} says so on stderr", file=sys.stderr, flush=True)
os.close(1)
os.close(2)
"""


def test_a_program_that_closes_its_stdout_and_stderr_ends_as_under_torchrun(tmp_path):
    """Exit 0 under torchrun; the rank's own flush at the end raised EBADF and failed the job. What
    the rank wrote to stderr is on the launcher's stderr, its stdout on stdout, under both (#45)."""
    torchrun, done = under_both(tmp_path, "closes_output.py", CLOSES_OUTPUT)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert done.returncode == 0 and "all 2 ranks finished" in done.stderr, done.stderr[-3000:]
    for launcher in (torchrun, done):
        assert "rank 0 closes its output" in launcher.stdout and "closes its output" not in launcher.stderr
        assert "rank 0 says so on stderr" in launcher.stderr and "on stderr" not in launcher.stdout


READS_STDIN = """
import os
try:
    input()
    print(f"rank {os.environ['RANK']} read a line")
except EOFError:
    print(f"rank {os.environ['RANK']} got EOFError")
"""


def test_input_never_stops_a_rank_run_from_a_terminal(tmp_path):
    """On a terminal, a Ray worker's stdin is that terminal, from a background process group: input()
    stopped the rank (SIGTTIN) until the hang timeout. A rank reads end-of-file."""
    if shutil.which("script") is None:
        pytest.skip("util-linux `script` (a pseudo-terminal) is not installed")
    env = base_env(tmp_path)
    script = tmp_path / "reads_stdin.py"
    script.write_text(READS_STDIN)
    cmd = (f"{sys.executable} {REPO / 'main.py'} --device cpu --gpus-per-node 2 --log-ranks all --runs-dir "
           f"{tmp_path / 'runs'} {script}")  # fmt: skip
    done = subprocess.run(["script", "-qec", cmd, "/dev/null"], env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, cwd=tempfile.gettempdir())  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert "rank 0 got EOFError" in done.stdout and "rank 1 got EOFError" in done.stdout, done.stdout[-3000:]


ON_SPARES = """
import os, runpy, sys, time
from launcher import report
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    report(1)  # progress: the warm spares of the next attempt start now
    go, deadline = sys.argv[1], time.time() + 120
    while not os.path.exists(go) and time.time() < deadline:  # the test: the spares are ready
        time.sleep(0.2)
    sys.exit(3 if os.environ["RANK"] == "1" else 0)
sys.argv = sys.argv[2:]  # the probe's own command line: probe.py OUT
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_warm_spares_run_the_next_attempt_in_the_process_torchrun_gives(tmp_path):
    """A restart on the warm spares (processes started beside the first attempt) runs the probe in
    the same process a cold start gives it, start-up variables included."""
    env = base_env(tmp_path)
    work, out = probe_dir(tmp_path, "spares")
    (work / "on_spares.py").write_text(ON_SPARES)
    go, log = tmp_path / "go", tmp_path / "driver.log"
    args = ("--device", "cpu", "--gpus-per-node", "2", "--runs-dir", str(tmp_path / "runs"), "--max-restarts",
            "1", "--env", "PYTHONHASHSEED=0", str(work / "on_spares.py"), str(go), str(work / "probe.py"),
            str(out))  # fmt: skip
    proc = drive.start(*args, env=env, cwd=work, log=log)
    try:
        deadline = time.monotonic() + 180
        while "warm spare(s) ready" not in log.read_text():  # then the first attempt fails
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        go.touch()
        assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "relaunching every rank (on the warm spares)" in log.read_text(), log.read_text()[-3000:]
    views = comparable(seen(out, 2), work)
    for v in views:
        assert v["nice"] == 0 and v["sig_blocked"] == "0000000000000000" and v["stdin"] == "EOFError"
        assert v["keyboard_interrupt"] == "raised" and v["child_sigint_exit"] == -2
        assert v["hash_randomization"] == 0 and v["breakpointhook"] is None and v["error_file_set"]
        assert v["sys_path"][0] == "<work>" and not any("/ray/" in p for p in v["sys_path"])
    assert len({v["hash"] for v in views}) == 1


OUTLIVED = Path(__file__).resolve().parent / "outlived.py"
# It writes what the Ray it runs on runs beside its raylet: the command lines of the raylet's parent's
# children (a Ray started by `ray.init` in the driver: the GCS, the raylet, Ray's monitors if started).
RUNS_UNTIL_STOPPED = """
import os, sys, time
def parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
raylet = os.getpid()
while open(f"/proc/{raylet}/comm").read().strip() != "raylet":
    raylet = parent(raylet)
driver = parent(raylet)
def children(pid):  # each child's command line, its arguments apart
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if parent(entry) == pid:
                with open(f"/proc/{entry}/cmdline") as f:
                    found.append(f.read().split(chr(0)))
        except OSError:
            pass
    return found
beside = [" ".join(argv) for argv in children(driver)]
with open(os.path.join(sys.argv[1], f"beside-{os.environ['RANK']}"), "w") as f:
    f.write(chr(10).join(beside))
with open(f"/proc/{raylet}/cmdline") as f:
    command = f.read().replace(chr(0), " ")
with open(os.path.join(sys.argv[1], f"raylet-{os.environ['RANK']}"), "w") as f:
    f.write(command)
if os.environ["RANK"] == "1":  # once rank 0 runs too (the launch's workers all started): the raylet's
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(sys.argv[1], "running-0")) and time.monotonic() < deadline:
        time.sleep(0.1)
    with open(os.path.join(sys.argv[1], "workers-1"), "w") as f:
        f.write(chr(10).join(argv[0] for argv in children(raylet)))
open(os.path.join(sys.argv[1], f"running-{os.environ['RANK']}"), "w").close()
time.sleep(600)
"""


def outlived(
    tmp_path: Path, *args: str, term_once: Path | None = None, python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> tuple[dict, str]:  # fmt: skip
    """megaray run by tests/outlived.py: ({"rc", "left": what outlived it}, its stderr); `env`, added
    to the user's environment."""
    wrap = [sys.executable, str(OUTLIVED), *(("--term-once", str(term_once)) if term_once else ()), "--"]
    megaray = [python, str(REPO / "main.py"), "--runs-dir", str(tmp_path / "runs"), *args]
    p = subprocess.run([*wrap, *megaray], cwd=tmp_path, env={**base_env(tmp_path), **(env or {})},
                       capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)  # fmt: skip
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def python_without(tmp_path: Path, *hidden: str) -> str:
    """A Python with this one's installed packages but those whose names start with `hidden`: a
    venv whose site-packages links to every other entry of ours (the editable megaray included)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = str(venv / "bin" / "python")
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    found = subprocess.run([python, "-c", where], capture_output=True, text=True, check=True)
    site = Path(found.stdout.strip())
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(hidden):
            (site / entry.name).symlink_to(entry)
    return python


def test_a_ray_started_for_the_launch_is_stopped_with_every_process_it_started(tmp_path):
    """#45: megaray stops the Ray it started for a launch (its own, or simulated nodes) without
    waiting a second for Ray's autoscaler monitor, and SIGTERM ends it as soon as its ranks are gone;
    whatever the ending, no process of that Ray outlives the command (its raylet's agents, which a
    raylet killed without its stop would leave running, included).

    #44: both run on an install with aiohttp but not aiohttp_cors, as a GPU image had it: Ray takes it
    for a minimal one and starts its agents with `--minimal`. megaray starts that Ray's raylet while its
    API server comes up; both used to ask whether the install was minimal at once, the raylet got the
    wrong answer, and its agent died (the node "timed out during startup", every launch there)."""
    python = python_without(tmp_path, "aiohttp_cors")
    script = tmp_path / "runs_until_stopped.py"
    script.write_text(RUNS_UNTIL_STOPPED)
    out = tmp_path / "out"
    out.mkdir()
    # Ray deciding as on a 16-core node (the core count its Python asks, in every process of the launch)
    cores = tmp_path / "sixteen-cores"
    cores.mkdir()
    sixteen = "import multiprocessing, os\nos.cpu_count = multiprocessing.cpu_count = lambda: 16\n"
    (cores / "sitecustomize.py").write_text(sixteen)
    ended, err = outlived(tmp_path, "--device", "cpu", "--gpus-per-node", "2", str(script), str(out),
                          term_once=out / "running-1", python=python,
                          env={"PYTHONPATH": str(cores)})  # fmt: skip
    assert ended == {"rc": 143, "left": []}, err[-3000:]
    assert "starting a local Ray for this run" in err and "interrupted by SIGTERM" in err, err[-3000:]
    # a Ray private to the launch, whose ranks' output megaray collects: neither Ray's autoscaler
    # monitor (nothing to scale), its log monitor (nobody reads what it tails) nor its API server (its
    # usage-stats reporter) runs beside its raylet
    beside = (out / "beside-1").read_text()  # written before running-1
    assert "raylet" in beside and "gcs_server" in beside, beside
    assert "monitor.py" not in beside, beside  # autoscaler/_private/monitor.py, _private/log_monitor.py
    assert "dashboard.py" not in beside, beside
    # its raylet's dashboard agent takes any free port, not Ray's default, which another Ray on the
    # machine may hold (the agent then retried it for 3.4 s, a launch of 4 s took 8)
    assert "--listen-port=0 " in (out / "raylet-1").read_text()  # written before running-1
    # nor the idle workers Ray starts for a first driver, one per core (16 here, 13 of them idle), for
    # which that driver's `ray.init` waits: the raylet's Python workers are the ranks and the output sink
    workers = (out / "workers-1").read_text().split("\n")
    assert "ray::IDLE" not in workers and sum(w.startswith("ray::RankActor") for w in workers) == 2, workers
    two_nodes = ("--device", "cpu", "--nodes", "2", "--gpus-per-node", "1")  # simulated, a program to its end
    ended, err = outlived(tmp_path, *two_nodes, str(PROBE), str(out), python=python)
    assert ended == {"rc": 0, "left": []}, err[-3000:]
    assert "simulating 2 node(s)" in err, err[-3000:]


def test_a_rank_pid_another_process_holds_now_is_neither_killed_nor_inspected():
    """The node's exit watch kills a rank process still running past the grace, and a hang's inspection
    signals it (SIGUSR1, for its faulthandler); both by the pid the rank reported with its start time:
    a pid another process has taken since is left alone (it was killed by pid alone)."""
    from launcher.core.deaths import RecordedProcess
    from launcher.rank.probes import inspect_process, stat, wait_exited

    stranger = subprocess.Popen(["sleep", "60"])
    try:
        started = stat(stranger.pid).start_ticks
        as_recorded_before = RecordedProcess(stranger.pid, started - 1)  # the rank that had the pid
        assert inspect_process(as_recorded_before)["state"] == "gone"
        took, _ = wait_exited([as_recorded_before], grace_s=0.3)
        assert took[0] is not None and stranger.poll() is None  # gone, as the rank is; the stranger runs
        took, _ = wait_exited([RecordedProcess(stranger.pid, started)], grace_s=0.3)
        assert took == [None] and stranger.wait(timeout=10) == -signal.SIGKILL  # the rank itself: killed
    finally:
        stranger.kill()
        stranger.wait()
