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

from launcher.driver.cluster.owned import session_members

from . import drive
from .conftest import REPO, ray_starting
from .test_process import PROBE as PROCESS_PROBE


@pytest.fixture
def env():
    e = drive.user_env(drop=("RAY_AUTH_",))
    # not the user's own `megaray up`; short, for the Unix sockets under Ray's temp dir in there
    e["MEGARAY_STATE_DIR"] = tempfile.mkdtemp(prefix="mru-", dir="/tmp")
    # a fresh machine's: no Ray token in it, whatever an earlier test or session left in the real one
    e["HOME"] = tempfile.mkdtemp(prefix="mru-home-")
    yield e
    shutil.rmtree(e["MEGARAY_STATE_DIR"], ignore_errors=True)
    shutil.rmtree(e["HOME"], ignore_errors=True)


def megaray(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return drive.run(*args, env=env, timeout=timeout)


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


def ray_workers_of(path: str) -> list[str]:
    """The Ray worker processes (actors, tasks; not Ray's agents) of the raylets started under `path`."""
    raylets = {p.split(":")[0] for p in processes_under(path) if "/raylet " in p}
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            ppid = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:"))
            if ppid in raylets and cmdline.startswith("ray::") and "Agent" not in cmdline:
                found.append(f"{entry.name}: {cmdline.strip()}")
    return found


def test_up_holds_a_local_ray_that_launches_attach_to_and_down_leaves_nothing(env, tmp_path):
    state = env["MEGARAY_STATE_DIR"]
    decoys: list[subprocess.Popen] = []
    try:
        # two at once (#46): one starts a Ray, the other waits for it and finds it running. Their nodes
        # have Ray's 30 s to register, which one overran beside another worker's busy-on-purpose test in
        # a fresh-clone run (it failed, the other then started its own): conftest.ray_starting
        with ray_starting():
            other = drive.start(
                "up", "--nodes", "2", "--gpus-per-node", "2", env=env, log=tmp_path / "other-up"
            )
            up = megaray(env, "up", "--nodes", "2", "--gpus-per-node", "2")
            assert other.wait(timeout=180) == 0, (tmp_path / "other-up").read_text()[-3000:]
        other_said = (tmp_path / "other-up").read_text()
        if "already running at 127.0.0.1:" in up.stderr:  # the other one started it: its output is the test's
            up = subprocess.CompletedProcess(up.args, 0, "", other_said)
        else:
            assert "already running at 127.0.0.1:" in other_said, f"{other_said[-3000:]}\n{up.stderr[-3000:]}"
        assert up.returncode == 0, up.stderr[-3000:]
        # a fresh HOME has no token: one is made where Ray looks, said in one line, private to the user
        token = Path(env["HOME"]) / ".ray" / "auth_token"
        assert f"no Ray token on this machine yet: made one in {token}" in up.stderr, up.stderr
        assert len(token.read_text()) == 64 and token.stat().st_mode & 0o777 == 0o600
        assert "sending the token" not in up.stderr  # its own token is not news
        assert re.search(r"started a local Ray at 127\.0\.0\.1:\d+ \(2 node\(s\) x 2 CPU ranks\)", up.stderr)
        said = up.stderr.index("megaray: starting a local Ray of 2 node(s) x 2 CPU ranks, then its pool")
        assert said < up.stderr.index("started a local Ray at")  # before the seconds the nodes take
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
        doctor = megaray(env, "doctor")  # no address: the Ray of `megaray up`, as a launch finds it
        assert doctor.returncode == 0, doctor.stdout[-3000:] + doctor.stderr[-3000:]
        assert "attaching to the local Ray of `megaray up`" in doctor.stderr
        assert "nodes (2):" in doctor.stdout and "links between nodes" in doctor.stdout, doctor.stdout

        # precedence: --address, then RAY_ADDRESS, before a running `megaray up`
        for extra, more_env in ((["--address", "127.0.0.1:9"], {}), ([], {"RAY_ADDRESS": "127.0.0.1:9"})):
            refused = megaray({**env, **more_env}, *extra, "--device", "cpu", "examples/torchrun_script.py")
            assert refused.returncode == 2 and "cannot reach a Ray cluster at 127.0.0.1:9" in refused.stderr
        a_node_of_up_killed_leaves_launches_one_line(env, runs)
        # the user's own processes that name the cluster's folder: not megaray's to stop
        decoys += [
            # -F: it follows the name, so a log Ray has not written (yet) cannot end it by itself
            subprocess.Popen(
                ["tail", "-F", f"{state}/ray/session_latest/logs/raylet.out"], stderr=subprocess.DEVNULL
            ),
            subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(600)", f"{state}/ray-notes.txt"]
            ),
        ]
    finally:
        down = megaray(env, "down")
    assert down.returncode == 0 and "stopped the local Ray at 127.0.0.1:" in down.stderr, down.stderr
    assert "killed" not in down.stderr  # every node stopped on its SIGTERM
    try:
        assert [d.poll() for d in decoys] == [None, None]
        mine = sorted(f"{d.pid}: {(' '.join(d.args) + ' ')[:120]}" for d in decoys)
        assert sorted(processes_under(state)) == mine  # nothing else
    finally:
        for d in decoys:
            d.kill()
            d.wait()
    assert not (Path(state) / "up.json").exists()
    again = megaray(env, "down")
    assert again.returncode == 0 and "no `megaray up` is running" in again.stderr
    listed = megaray(env, "list")  # nothing runs: said, not an error
    assert listed.returncode == 0 and "nothing runs here" in listed.stdout, listed.stdout + listed.stderr


def test_down_never_signals_a_recorded_pid_that_is_now_another_process(env):
    """A state file left from an earlier boot, whose pid is now the user's process: that process is
    not megaray's (its start time differs from the one recorded) and is left alone."""
    import json

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        state = {"address": "127.0.0.1:9", "nodes": 1, "gpus_per_node": 1, "device": "cpu",
                 "pids": [other.pid], "temp_dir": "/nowhere", "started_at": 0.0, "starts": [1]}  # fmt: skip
        (Path(env["MEGARAY_STATE_DIR"]) / "up.json").write_text(json.dumps(state))
        down = megaray(env, "down")
        assert down.returncode == 0 and "no `megaray up` is running" in down.stderr, down.stderr
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_up_with_a_token_path_that_holds_no_token_exits_2_in_one_line(env):
    missing = Path(env["HOME"]) / "cluster-token"
    p = megaray({**env, "RAY_AUTH_TOKEN_PATH": str(missing)}, "up")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"RAY_AUTH_TOKEN_PATH names {missing}, which holds no token" in p.stderr
    assert not missing.exists() and not (Path(env["HOME"]) / ".ray").exists()
    assert processes_under(env["MEGARAY_STATE_DIR"]) == []


def test_up_refuses_simulated_gpu_nodes_in_one_line(env):
    p = megaray(env, "up", "--nodes", "2", "--device", "gpu")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "use --device cpu" in p.stderr
    assert not (Path(env["MEGARAY_STATE_DIR"]) / "up.json").exists()


PROBE = """
import atexit, json, os, sys
import probepkg.helper
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
out, rank = sys.argv[1], os.environ["RANK"]
seen = {
    "name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(), "threads": torch.get_num_threads(),
    "modules": sorted(k for k in sys.modules if k.split(".")[0] == "probepkg"),
    "helper_runs": probepkg.helper.RUNS,
    "env": {k: v for k, v in os.environ.items() if k in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "OMP_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RESTART_COUNT", "PWD")},
}
atexit.register(lambda: open(os.path.join(out, f"atexit-{rank}"), "w").write("done"))
json.dump(seen, open(os.path.join(out, f"seen-{rank}.json"), "w"))
import runpy
runpy.run_path(sys.argv[2], run_name="__main__")  # what the process looks like (tests/test_process.py)
"""


def differences(views: list[dict], cold: list[dict]) -> dict:
    """What a rank saw that it did not see on a cold start, by rank and key."""
    out = {}
    for rank, (v, c) in enumerate(zip(views, cold, strict=True)):
        for key in v:
            if key == "process":
                out.update(
                    {
                        (rank, f"process.{k}"): _apart(v[key][k], c[key].get(k))
                        for k in v[key]
                        if v[key][k] != c[key].get(k)
                    }
                )
            elif v[key] != c.get(key):
                out[(rank, key)] = (v[key], c.get(key))
    return out


def imported_ahead(views: list[dict]) -> list[dict]:
    """The views but for the modules loaded before the program ran, which a warm pool imports."""
    return [{**v, "process": {k: x for k, x in v["process"].items() if k != "preloaded"}} for v in views]


def _apart(seen: object, cold: object) -> object:
    """Two lists of names as what only each has; other values as they are."""
    if isinstance(seen, list) and isinstance(cold, list) and all(isinstance(x, str) for x in seen + cold):
        return sorted(set(seen) - set(cold)), sorted(set(cold) - set(seen))
    return seen, cold


def probe_run(env: dict[str, str], tmp_path: Path, name: str, *extra: str) -> tuple[str, list[dict]]:
    """The probe on 2 ranks; what each rank saw, and the launch's output."""
    import json

    work = tmp_path / "work"
    (work / "probepkg").mkdir(parents=True, exist_ok=True)
    (work / "probepkg" / "__init__.py").write_text("")
    (work / "probepkg" / "helper.py").write_text("RUNS = globals().get('RUNS', 0) + 1\n")
    (work / "probe.py").write_text(PROBE)
    out = tmp_path / name
    out.mkdir()
    cmd = [sys.executable, str(REPO / "main.py"), "--device", "cpu", "--gpus-per-node", "2", "--runs-dir",
           str(tmp_path / "runs"), *extra, "probe.py", str(out), str(PROCESS_PROBE)]  # fmt: skip
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(f.name for f in out.iterdir() if f.name.startswith("atexit")) == ["atexit-0", "atexit-1"]
    seen = [json.loads((out / f"seen-{r}.json").read_text()) for r in range(2)]
    for r, s in enumerate(seen):
        assert s["argv"] == [str(out), str(PROCESS_PROBE)]
        s["argv"] = ["<out>"]  # the one thing that differs between the runs compared
        s["process"] = json.loads((out / f"process-{r}.json").read_text())
        if s["process"]["hash_randomization"]:
            s["process"]["hash"] = "random"  # differs between any two processes
    return p.stderr, seen


def test_pools_run_programs_as_a_cold_start_refill_and_give_back_when_idle(env, tmp_path):
    import time

    try:
        # no `megaray up`: a Ray started for the run, with Ray's 30 s for its node (conftest.ray_starting:
        # beside the sixteen-ranks test, load 27 on 2 cores, a fresh-clone run's did not come up)
        with ray_starting():
            cold_log, cold = probe_run(env, tmp_path, "cold")
        assert "starting a local Ray for this run" in cold_log and "taking the" not in cold_log
        with ray_starting():  # Ray's 30 s for its node, as in the test above
            up = megaray(env, "up", "--gpus-per-node", "2")
        assert up.returncode == 0 and "with a pool (one process per rank, started, nothing imported)" in (
            up.stderr
        ), up.stderr[-2000:]
        started_log, started = probe_run(env, tmp_path, "started")
        assert "taking the pool (2 processes started, nothing imported)" in started_log
        assert started == cold, differences(started, cold)
        # on the same pool, refilled: a launch whose driver was killed, then `down` while one runs
        a_pool_taken_by_a_launch_whose_driver_was_killed_is_free(env, tmp_path)
        with ray_starting():
            up = megaray(env, "up", "--gpus-per-node", "2", "--warm", "--idle-timeout", "12")
        assert up.returncode == 0 and "with a warm pool" in up.stderr, up.stderr[-2000:]
        listed = megaray(env, "list")
        assert re.search(
            r"megaray up: 127\.0\.0\.1:\d+ \(1 node\(s\) x 2 CPU ranks\), up \d+ min", listed.stdout
        )
        assert re.search(r"warm pool at 127\.0\.0\.1:\d+: 1 node\(s\) x 2 CPU ranks, ready: 2 process",
                         listed.stdout), listed.stdout + listed.stderr  # fmt: skip
        deadline = time.monotonic() + 60  # the pool: 2 rank processes and the launch's output sink
        while len(workers := ray_workers_of(env["MEGARAY_STATE_DIR"])) != 3:
            assert time.monotonic() < deadline, workers
            time.sleep(0.5)
        warm_log, warm = probe_run(env, tmp_path, "warm")
        assert "taking the warm pool (2 processes with torch imported)" in warm_log
        # the program cannot tell: __main__, argv, cwd, env, its modules fresh, threads; only what was
        # imported before it ran differs (torch and megatron's stack, the pool's reason to be)
        assert imported_ahead(warm) == imported_ahead(cold), differences(
            imported_ahead(warm), imported_ahead(cold)
        )
        assert warm[0]["modules"] == ["probepkg", "probepkg.helper"] and warm[0]["helper_runs"] == 1
        ahead = set(warm[0]["process"]["preloaded"]) - set(cold[0]["process"]["preloaded"])
        assert "megatron" in ahead, ahead  # `up --warm`: the dry run's stack
        again_log, again = probe_run(env, tmp_path, "again")  # the pool was refilled after the last launch
        assert "taking the warm pool" in again_log and imported_ahead(again) == imported_ahead(cold)
        # with what that launch (a torch script) imported ahead: torch, not the dry run's megatron-core
        ahead = set(again[0]["process"]["preloaded"]) - set(cold[0]["process"]["preloaded"])
        assert "torch" in again[0]["process"]["preloaded"] and "megatron" not in ahead, ahead
        # the pool refilled after that launch (it imports first) gives its bundles back when unclaimed
        # for --idle-timeout: the pool's processes and its output sink end, and `megaray list` says so
        # (asked once they have: each `list` is a process that imports Ray)
        deadline = time.monotonic() + 120
        while workers := ray_workers_of(env["MEGARAY_STATE_DIR"]):
            assert time.monotonic() < deadline, workers
            time.sleep(0.5)
        while "given back" not in (listed := megaray(env, "list").stdout):
            assert time.monotonic() < deadline, listed
            time.sleep(1)
        idle_log, after_idle = probe_run(env, tmp_path, "after-idle")
        assert "the warm pool is not there" in idle_log and after_idle == cold
        # a start-up variable the pool's processes (refilled after the last launch) did not start with:
        # given back, started afresh
        seeded_log, seeded = probe_run(env, tmp_path, "seeded", "--env", "PYTHONHASHSEED=0")
        assert "sets start-up variables (PYTHONHASHSEED), which the warm pool's" in seeded_log
        assert "taking the" not in seeded_log, seeded_log[-3000:]
        assert {s["process"]["hash_randomization"] for s in seeded} == {0}
        assert len({s["process"]["hash"] for s in seeded}) == 1
    finally:
        down = megaray(env, "down")
    assert down.returncode == 0
    assert processes_under(env["MEGARAY_STATE_DIR"]) == []


def test_a_read_only_state_dir_is_one_line(tmp_path):
    """#46: a MEGARAY_STATE_DIR on a read-only filesystem (mounted so in a mount namespace of the
    command's own) gave `megaray up` a 24-line traceback."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a read-only mount needs root and util-linux's unshare")
    state = tmp_path / "state"
    state.mkdir()
    shell = f'mount -t tmpfs -o ro none "{state}" && exec "$@"'
    for argv in (["up"], ["list"]):
        p = subprocess.run(["unshare", "--mount", "sh", "-c", shell, "sh", sys.executable, "main.py", *argv],
                           cwd=REPO, env={**os.environ, "MEGARAY_STATE_DIR": str(state)}, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-3000:]
        assert f"MEGARAY_STATE_DIR names {state}, which is not a folder megaray can use" in p.stderr


SLEEPS = """
import os, time
open(os.path.join(os.environ["OUT"], f"running-{os.environ['RANK']}"), "w").write(str(os.getpid()))
time.sleep(600)
"""


def a_pool_taken_by_a_launch_whose_driver_was_killed_is_free(env: dict[str, str], tmp_path: Path) -> None:
    """On a running `megaray up` (1 node x 2) whose pool was taken and is refilled: kill -9 of a
    driver whose launch took the pool: the pool's processes go on running its ranks, and the claim
    stays; `megaray list` says the job ended, and the next launch gives the pool back (ending those
    ranks) and runs. Then `megaray down` while a launch runs: both say so. (Formerly a test of its
    own with an `up` of its own; part of test_pools_run_programs_as_a_cold_start_....)"""
    import signal
    import time

    (tmp_path / "sleeps.py").write_text(SLEEPS)
    runs = ["--device", "cpu", "--gpus-per-node", "2", "--runs-dir", str(tmp_path / "runs")]
    deadline = time.monotonic() + 60  # the pool refilled after the last launch took it: its 2 processes
    while len(ray_workers_of(env["MEGARAY_STATE_DIR"])) < 2:  # first, without a `list` process each time
        assert time.monotonic() < deadline
        time.sleep(0.2)
    while "ready: 2 process" not in (listed := megaray(env, "list").stdout):
        assert time.monotonic() < deadline, listed
        time.sleep(0.5)
    driver = subprocess.Popen([sys.executable, str(REPO / "main.py"), *runs, "--env", f"OUT={tmp_path}",
                               "sleeps.py"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"running-{r}").exists() for r in range(2)):
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    ranks = [int((tmp_path / f"running-{r}").read_text()) for r in range(2)]
    # meanwhile, a second launch of the layout: the pool is in use and the local Ray cannot grow, so
    # it fails within seconds (it waited out --placement-timeout, 120 s): it says the Ray cannot grow,
    # which caps its wait at 10 s (tests/test_topology_pure.py); 2 s asked here, to spare the wait
    t0 = time.monotonic()
    second = megaray(env, *runs, "--placement-timeout", "2", "examples/torchrun_script.py")
    assert second.returncode == 2 and "not placed within 2s" in second.stderr, second.stderr[-3000:]
    assert "started for this run or by `megaray up`, cannot grow" in second.stderr, second.stderr[-3000:]
    assert "in use by job" in second.stderr and time.monotonic() - t0 < 60
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 30  # Ray marks the driver's job dead when its connection closes
    while "which ended without giving it back" not in (listed := megaray(env, "list").stdout):
        assert time.monotonic() < deadline, listed
        time.sleep(1)
    again = megaray(env, *runs, "examples/torchrun_script.py")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "which ended without giving it back: given back" in again.stderr
    for pid in ranks:  # the killed launch's ranks ended with the pool's processes
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    # `down` while a launch runs on it (#46): down names the launch it ends, which says why it failed
    # (it blamed a crash or the OOM killer)
    (tmp_path / "second").mkdir()
    log = tmp_path / "second.log"
    driver = drive.start(*runs, "--env", f"OUT={tmp_path / 'second'}", "sleeps.py", env=env, cwd=tmp_path,
                         log=log)  # fmt: skip
    deadline = time.monotonic() + 120
    while not all((tmp_path / "second" / f"running-{r}").exists() for r in range(2)):
        assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    down = megaray(env, "down")
    assert down.returncode == 0 and f"stopping it ends 1 launch(es) running on it: pid {driver.pid}" in (
        down.stderr
    ), down.stderr[-3000:]
    assert driver.wait(timeout=120) == 1
    assert "was stopped meanwhile (`megaray down`): its ranks ended with it" in log.read_text(), (
        log.read_text()[-3000:]
    )
    assert processes_under(env["MEGARAY_STATE_DIR"]) == []


def test_sigterm_while_up_starts_its_nodes_leaves_nothing(env):
    """SIGTERM once the head runs, while the next node starts: the nodes started are stopped, one line,
    exit 143 (Ray's own handler aborted the process, and the last node stayed up)."""
    import signal
    import time

    state = env["MEGARAY_STATE_DIR"]
    up = subprocess.Popen([sys.executable, "main.py", "up", "--nodes", "2", "--gpus-per-node", "1"], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 90
    while not any("/raylet " in p for p in processes_under(state)):
        assert up.poll() is None and time.monotonic() < deadline, up.communicate()
        time.sleep(0.1)
    up.send_signal(signal.SIGTERM)
    _, err = up.communicate(timeout=90)
    assert up.returncode == 143, err[-3000:]
    # Ray's SIGTERM handler drained a node still starting for 30 s (its log says so), then megaray
    # killed it; the seconds the up takes to end are not asserted (a busy machine sets them)
    assert "Draining for up to" not in (Path(state) / "up.log").read_text()
    assert "interrupted by SIGTERM: stopped the nodes started so far" in err and "Traceback" not in err
    assert processes_under(state) == [] and not (Path(state) / "up.json").exists()


def a_node_of_up_killed_leaves_launches_one_line(env: dict[str, str], runs: str) -> None:
    """One node of a running `megaray up` (2 nodes x 2) killed (its `ray start` and raylet): its pool
    processes are gone (a launch of the pool's layout got a traceback, and one of another layout
    waited 120 s beside the pool's held bundle). Now: the pool is given back, a launch that no longer
    fits fails in seconds, one that fits runs; the caller's `megaray down` then stops what is left.
    (Formerly a test of its own, with an `up` of its own.)"""
    import json
    import signal
    import time

    second = json.loads((Path(env["MEGARAY_STATE_DIR"]) / "up.json").read_text())["pids"][1]
    # the node lost: its `ray start` and its raylet (the process group megaray started it in)
    os.killpg(second, signal.SIGKILL)
    deadline = time.monotonic() + 30  # its workers (the pool's processes) end when they see it gone
    while session_members(second, None):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    t0 = time.monotonic()
    layout = ["--device", "cpu", "--gpus-per-node", "2", "--runs-dir", runs]
    lost = megaray(env, *layout, "--nodes", "2", "examples/torchrun_script.py")
    assert lost.returncode == 2 and "Traceback" not in lost.stderr, lost.stderr[-3000:]
    gone = ("has lost a process", "is not there")  # told by its call failing, or Ray knows already
    assert any(g in lost.stderr for g in gone) and time.monotonic() - t0 < 90, lost.stderr[-3000:]
    fits = megaray(env, *layout, "examples/torchrun_script.py")
    assert fits.returncode == 0, fits.stderr[-3000:]


# Stand-ins for `ray start --head`: the first as a head whose GCS could not bind its port (the lines
# Ray prints then, ray/_private/node.py), the second a head whose GCS answers on the port it is given.
GCS_FAILED = "echo 'RuntimeError: Failed to start GCS.  Last 1 lines of error files: ...'"
GCS_ANSWERS = """
import socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
with socket.create_server(("127.0.0.1", port)) as s:
    time.sleep(60)
"""


def test_a_head_whose_gcs_exits_as_it_starts_is_started_again_on_another_port(tmp_path):
    """`megaray up` got exit 2 in a CI run: its head's GCS exited as it started (its port, picked free
    from the ephemeral range, taken meanwhile). The port comes from below that range now, and such a
    head is started once more; one that fails otherwise is not."""
    from launcher.core.errors import ClusterError
    from launcher.driver.cluster import up_nodes

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low > up_nodes.QUIET_PORTS_FROM + 100:  # else the kernel's pick: a machine set up otherwise
        assert all(up_nodes.QUIET_PORTS_FROM <= up_nodes.free_port() < low for _ in range(20))
    log, asked = tmp_path / "up.log", []

    def start(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
        asked.append(args[args.index("--port") + 1])
        with open(log_path, "a") as out:
            if len(asked) == 1:
                return subprocess.Popen(["sh", "-c", f"{GCS_FAILED}; exit 1"], stdout=out, stderr=out)
            return subprocess.Popen([sys.executable, "-c", GCS_ANSWERS, *args], stdout=out, stderr=out)

    procs: list[subprocess.Popen] = []
    try:
        address = up_nodes.start_head(["--num-cpus", "1"], log, {}, procs, start=start)
        assert len(asked) == 2 and address == f"127.0.0.1:{asked[1]}" and len(procs) == 1, (asked, address)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    failing = lambda args, log_path, env: subprocess.Popen(["sh", "-c", "echo 'no such option'; exit 2"])  # noqa: E731
    procs = []
    with pytest.raises(ClusterError, match="did not start"):
        up_nodes.start_head([], log, {}, procs, start=failing)
    assert len(procs) == 1  # not started again: not the GCS's port
