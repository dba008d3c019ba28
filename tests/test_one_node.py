"""Tier 2: one Ray node started in this process, ranks over gloo, `main()` called in-process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from launcher.cli import main
from launcher.rank.probes import interface_of

from .conftest import REPO, free_port, leftovers, read_ranks


@pytest.fixture(scope="module", autouse=True)
def one_node():
    os.chdir(REPO)  # entrypoints resolve from the working directory, as torchrun's scripts do
    ray.init(address="local", num_cpus=4, num_gpus=2, namespace="megaray", include_dashboard=True,
             dashboard_port=free_port())  # fmt: skip
    yield
    ray.shutdown()


def launch(job, *args, out=None):
    env = ["--env", f"MEGARAY_TEST_OUT={out}"] if out else []
    return main(["--job-name", job, "--placement-timeout", "20", *env, *args])


def test_two_cpu_ranks_get_the_torchrun_contract_and_all_reduce(out, capsys):
    assert (
        launch(
            "envcpu",
            "--device",
            "cpu",
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            "--entrypoint",
            "tests.targets:dump_env",
            "a",
            "--b",
            out=out,
        )
        == 0
    )
    seen = read_ranks(out, "env", 2)
    for rank, s in enumerate(seen):
        e = s["env"]
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "2",
            "2",
        )
        assert (e["GROUP_RANK"], e["NODE_RANK"], e["GROUP_WORLD_SIZE"], e["ROLE_NAME"]) == (
            "0",
            "0",
            "1",
            "default",
        )
        assert e["TORCHELASTIC_RUN_ID"] == "envcpu" and e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # rank 0's process serves the store
        assert (e["OMP_NUM_THREADS"], e["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == ("1", "1")
        assert e["CUDA_VISIBLE_DEVICES"] == ""  # CPU mode: no GPU is visible to the program
        assert s["argv"] == ["tests.targets", "a", "--b"]
        assert e["PWD"] == s["cwd"] == str(REPO)  # as a shell sets it, not the `ray start` folder
        iface = interface_of(e["MASTER_ADDR"])  # one node: the interface of its Ray IP, not the hostname's
        assert iface and (e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"]) == (iface, f"={iface}")
        assert not s["torch_preloaded"]
    assert seen[0]["env"]["MASTER_ADDR"] == seen[1]["env"]["MASTER_ADDR"]
    port = int(seen[0]["env"]["MASTER_PORT"])
    assert 20000 <= port < 30000 and seen[1]["env"]["MASTER_PORT"] == str(port)
    err = capsys.readouterr().err
    assert "topology (MASTER_ADDR=" in err and "all 2 ranks finished" in err
    assert leftovers("envcpu") == ([], [])

    assert (
        launch(
            "gloo",
            "--device",
            "cpu",
            "--gpus-per-node",
            "2",
            "--entrypoint",
            "tests.targets:gloo_allreduce",
            out=out,
        )
        == 0
    )
    assert [r["sum"] for r in read_ranks(out, "allreduce", 2)] == [1.0, 1.0]


def test_declared_gpus_map_local_rank_to_the_ray_gpu(out):
    assert launch("envgpu", "--gpus-per-node", "2", "--entrypoint", "tests.targets:dump_env", out=out) == 0
    seen = read_ranks(out, "env", 2)
    assert sorted(g for s in seen for g in s["ray_gpu_ids"]) == ["0", "1"]
    for s in seen:
        visible = s["env"]["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[int(s["env"]["LOCAL_RANK"])] == s["ray_gpu_ids"][0]
    assert seen[0]["env"]["CUDA_VISIBLE_DEVICES"] == seen[1]["env"]["CUDA_VISIBLE_DEVICES"]


def test_script_runs_as_main_with_argv_and_profile_and_env_reach_every_rank(out, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import json, os, sys\n"
        "assert __name__ == '__main__'\n"
        f"open(os.path.join({str(out)!r}, 'script-' + os.environ['RANK']), 'w').write(json.dumps(\n"
        "    {'argv': sys.argv, 'fi': os.environ.get('FI_PROVIDER'),\n"
        "     'flag': os.environ.get('MEGARAY_TEST_FLAG'), 'buff': os.environ.get('NCCL_BUFFSIZE')}))\n"
    )
    out.mkdir(parents=True)
    assert (
        launch(
            "script",
            "--device",
            "cpu",
            "--gpus-per-node",
            "2",
            "--env-profile",
            "efa",
            "--env",
            "MEGARAY_TEST_FLAG=on",
            "--env",
            "NCCL_BUFFSIZE=1024",
            str(script),
            "--lr",
            "3e-4",
        )
        == 0
    )
    for rank in range(2):
        got = json.loads((out / f"script-{rank}").read_text())
        assert got == {"argv": [str(script), "--lr", "3e-4"], "fi": "efa", "flag": "on", "buff": "1024"}


def test_a_rank_that_raises_fails_the_job_naming_it(capsys):
    t0 = time.monotonic()
    assert (
        launch(
            "raises",
            "--device",
            "cpu",
            "--gpus-per-node",
            "2",
            "--entrypoint",
            "tests.targets:fail_on_rank_1",
        )
        == 1
    )
    assert time.monotonic() - t0 < 30  # the other rank sleeps 60 s: it was stopped, not waited for
    err = capsys.readouterr().err
    assert "Root cause (first failure):" in err
    assert "rank      : 1 of 2" in err
    assert "ValueError: rank one refuses on purpose" in err
    assert 'targets.py", line' in err  # the rank's own traceback
    assert leftovers("raises") == ([], [])


def test_ranks_failing_together_are_all_listed(out, tmp_path, capsys):
    """#45 item 5: four ranks raising at the same moment reach the driver at their own pace, some
    after the first failure's window: the report named 2 of 4 now and then. Every rank that failed
    before the stop began is listed, the root cause first, as torchrun lists every failed worker."""
    args = ("--device", "cpu", "--gpus-per-node", "4", "--runs-dir", str(tmp_path), "--entrypoint",
            "tests.targets:fail_together")  # fmt: skip
    assert launch("together", *args, out=out) == 1
    err = capsys.readouterr().err
    assert "Root cause (first failure):" in err and "what      : ValueError: bad batch" in err
    failed = json.loads((tmp_path / "together" / "summary.json").read_text())["failures"]
    assert sorted(f["rank"] for f in failed) == [0, 1, 2, 3], failed
    assert re.search(r"ranks [\d,-]+ \(3\) on \S+: ValueError: bad batch", err), err[-3000:]


def test_sys_exit_code_is_reported(capsys):
    assert (
        launch(
            "exits",
            "--device",
            "cpu",
            "--gpus-per-node",
            "2",
            "--entrypoint",
            "tests.targets:exit_3_on_rank_0",
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "rank      : 0 of 2" in err and "exit code : 3" in err
    # as torchrun's `exitcode: 3`: the program chose to exit, no traceback of SystemExit (#45 item 6)
    assert "traceback :" not in err and "SystemExit" not in err, err[-3000:]
    assert leftovers("exits") == ([], [])
    # sys.exit("message"): Python prints the message and exits 1; the rank's stderr has it as well
    args = ("--device", "cpu", "--gpus-per-node", "1", "--entrypoint", "tests.targets:exit_with_a_message")
    assert launch("exitsays", *args) == 1
    err = capsys.readouterr().err
    assert re.search(r"\[r0[^\]]*\] bad config: lr must be positive", err), err[-3000:]
    assert "exit code : 1" in err and "SystemExit" not in err, err[-3000:]


def test_a_killed_rank_takes_the_job_down_fast(out, capsys):
    def kill_rank_1():
        pid_file = out / "pid-rank1.json"
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(json.loads(pid_file.read_text())["pid"], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    code = launch(
        "sigkill",
        "--device",
        "cpu",
        "--gpus-per-node",
        "2",
        "--entrypoint",
        "tests.targets:wait_forever",
        out=out,
    )
    assert code == 1  # how fast: bench/failures.py's "rank death", against torchrun (not a timed assert)
    err = capsys.readouterr().err
    # whichever told first, the node (as the process started to exit) or Ray (once it was gone)
    assert "rank      : 1 of 2" in err and "SIGKILL" in err and "a signal sent from outside the job" in err
    assert leftovers("sigkill") == ([], [])


def test_a_dead_forwarder_ends_the_job_in_seconds_saying_so_not_as_a_hang(out, capsys):
    """#46: the node's output forwarder SIGKILLed while the ranks run (they print and would wait on it):
    the attempt ends within seconds, naming the forwarder, instead of at --hang-timeout as silent."""
    from ray.util.state import list_actors

    from .conftest import connected

    killed = []

    def kill_the_forwarder():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            mine = [("class_name", "=", "NodeForwarder"), ("state", "=", "ALIVE")]
            alive = list_actors(address=connected(), filters=mine, detail=True)
            if alive and (out / "pid-rank1.json").exists() and (out / "pid-rank0.json").exists():
                os.kill(alive[0].pid, signal.SIGKILL)
                killed.append(alive[0].pid)
                return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_the_forwarder, daemon=True)
    killer.start()
    code = launch("noforwarder", "--device", "cpu", "--gpus-per-node", "2", "--hang-timeout", "120",
                  "--entrypoint", "tests.targets:wait_forever", out=out)  # fmt: skip
    err = capsys.readouterr().err
    assert killed and code == 1, err[-3000:]
    assert "its node's output forwarder (megaray's helper process there) died while the rank ran" in err
    assert "no output or progress" not in err
    assert leftovers("noforwarder") == ([], [])


def test_a_node_s_forwarder_tells_a_rank_process_ending_with_its_status():
    """What the driver learns before Ray does (a process with GPU memory takes seconds to exit): the
    node's forwarder, a real actor, watching real processes. The killed one stays a zombie here (this
    test, its parent, does not reap it), as a GPU process stays in its exit while the driver frees
    its memory."""
    import subprocess
    import sys

    from launcher.driver.output.relay import _forwarder_class

    forwarder = _forwarder_class().remote(None, frozenset(), 1)
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        watch = forwarder.watch_ends.remote([p.pid for p in procs])
        assert ray.wait([watch], timeout=0.5)[0] == []  # both run: nothing to tell
        procs[1].send_signal(signal.SIGKILL)
        (end,) = ray.get(watch, timeout=10)
        assert (end.pid, end.exit_code, end.describe()) == (
            procs[1].pid, -9, "its process was killed by SIGKILL (signal 9)"
        )  # fmt: skip
    finally:
        for p in procs:
            p.kill()
            p.wait()
        ray.kill(forwarder)


REPORTS_AND_EXIT_ZERO = """
import decimal, os, sys
from launcher import report
report(1, loss="abc", total="100", tokens="x")  # loss and tokens left out, said once each
report(2, loss="abc")
report(float("nan"))  # no iteration: the report is left out
report("step-3")
report(3, loss=decimal.Decimal("2.5"), total=3)
print("reported", flush=True)
if os.environ["RANK"] == "1":
    os._exit(0)  # mid-program: a success under torchrun (its exit status decides)
open(os.path.join(sys.argv[1], "done-" + os.environ["RANK"]), "w").close()
"""


def test_report_never_fails_the_program_and_os_exit_zero_is_a_success(tmp_path, capsys):
    """#46: report() with values that are not numbers, and a rank that ends with os._exit(0); under
    torchrun report() is a no-op and a worker's exit status 0 is a success."""
    (tmp_path / "prog.py").write_text(REPORTS_AND_EXIT_ZERO)
    runs = tmp_path / "runs"
    code = launch("exitzero", "--device", "cpu", "--gpus-per-node", "2", "--log-ranks", "all", "--runs-dir",
                  str(runs), str(tmp_path / "prog.py"), str(tmp_path))  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert (tmp_path / "done-0").exists() and not (tmp_path / "done-1").exists()
    for rank in (0, 1):
        said = (runs / "exitzero" / f"rank-{rank}.log").read_text()
        assert said.count("report(): loss='abc' is not a number: left out of the progress") == 1, said
        assert said.count("report(): tokens='x' is not a number") == 1 and "reported" in said, said
        assert "report(): iteration=nan is not a whole number of 0 or more: the report is left out" in said
    assert "progress: iteration 3/3 | loss 2.5" in err, err[-3000:]
    summary = json.loads((runs / "exitzero" / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("succeeded", 0)
    assert leftovers("exitzero") == ([], [])


def test_os_exit_zero_marks_the_rank_process_only_not_a_forked_child(tmp_path):
    import subprocess
    import sys

    prog = (
        "import os, sys\n"
        "from launcher.rank.spool import mark_os_exit_zero\n"
        "mark_os_exit_zero(sys.argv[1])\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(os.path.exists(sys.argv[1]), flush=True)\n"
        "os._exit(int(sys.argv[2]))\n"
    )
    for status, marked in ((3, False), (0, True)):
        mark = tmp_path / f"mark-{status}"
        cmd = [sys.executable, "-c", prog, str(mark), str(status)]
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert (p.returncode, p.stdout.strip(), mark.exists()) == (status, "False", marked), p.stderr


DEATH_PROBE = """
import ctypes, os, sys, time
if os.environ["RANK"] == "1":
    for i in range(3):
        print(f"step {i}")
    print("last words before dying", flush=True)
    if sys.argv[1] == "segv":
        ctypes.string_at(0)
    os._exit(7)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["segv", "exit"])
def test_a_rank_that_dies_abruptly_keeps_its_last_output_and_names_the_signal(tmp_path, capsys, how):
    script = tmp_path / "die.py"
    script.write_text(DEATH_PROBE)
    args = ["--device", "cpu", "--gpus-per-node", "2", "--log-ranks", "all", "--runs-dir", str(tmp_path),
            str(script), how]  # fmt: skip
    assert launch("deathprobe", *args) == 1
    err = capsys.readouterr().err
    assert "rank      : 1 of 2" in err
    # the console has the rank's own lines, not Ray's failure handler's (#45 item 6); its log keeps all
    assert "SIGSEGV received" not in err and "logging.cc" not in err and "PC: @" not in err, err[-3000:]
    report = err[err.index("Root cause") :]
    assert "last output" in report and "    last words before dying" in report
    if how == "segv":
        assert "killed by SIGSEGV (segmentation fault" in report
        assert "Fatal Python error: Segmentation fault" in report  # faulthandler's stack, kept
        assert 'die.py", line 8 in <module>' in report and "logging.cc" not in report
    else:
        # told by the node as the process exits, or by Ray once it is gone
        assert "exited with code 7 (os._exit" in report or "fatal-error report: os._exit()" in report
    log = (tmp_path / "deathprobe" / "rank-1.log").read_text()
    assert log.count("[r1 n0] last words before dying") == 1 and "[r1 n0] step 0" in log
    if how == "segv":
        assert "Fatal Python error: Segmentation fault" in log and "SIGSEGV received" in log
        # faulthandler's frames of Ray's worker loop: in the log, not on the console (#45 item 6)
        assert "ray/_private/worker.py" in log and "ray/_private/worker.py" not in err, err[-3000:]
    assert leftovers("deathprobe") == ([], [])


def test_a_request_larger_than_the_cluster_exits_2_within_the_timeout(capsys):
    t0 = time.monotonic()
    assert (
        main(
            [
                "--job-name",
                "toobig",
                "--placement-timeout",
                "2",
                "--nodes",
                "2",
                "--gpus-per-node",
                "2",
                "--entrypoint",
                "tests.targets:dump_env",
            ]
        )
        == 2
    )
    assert time.monotonic() - t0 < 15
    err = capsys.readouterr().err
    assert "the cluster cannot fit 2 node(s) x 2 GPUs" in err
    assert "only 1 node(s) of the cluster can hold one group" in err
    assert "GPU 2/2 free" in err and "--placement-timeout" in err
    assert leftovers("toobig") == ([], [])


def test_a_busy_master_port_exits_2(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert (
            launch(
                "busyport",
                "--device",
                "cpu",
                "--master-port",
                str(port),
                "--entrypoint",
                "tests.targets:dump_env",
            )
            == 2
        )
    assert f"--master-port {port} is in use on the master node" in capsys.readouterr().err
    assert leftovers("busyport") == ([], [])


def _time_wait_on(port: int) -> bool:
    """A TCP connection in TIME-WAIT (state 06 of /proc/net/tcp) whose local end is `port`."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return any(row[1].endswith(f":{port:04X}") and row[3] == "06" for row in rows)


def test_a_master_port_left_in_time_wait_by_the_last_run_is_taken_as_under_torchrun(out, capsys):
    """Rerunning a command at once: the last run's store connections linger in TIME-WAIT on the port
    (the side that closed first keeps it a minute); torch's store binds it all the same
    (SO_REUSEADDR), and so does megaray."""
    import socket

    listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    listener.close()
    served.close()  # the store's side closes first: the port's end of this connection waits in TIME-WAIT
    client.recv(1)
    client.close()
    deadline = time.monotonic() + 5
    while not _time_wait_on(port):
        assert time.monotonic() < deadline, "no TIME-WAIT socket on the port"
        time.sleep(0.05)
    args = ["--device", "cpu", "--gpus-per-node", "2", "--master-port", str(port)]
    code = launch("reuseport", *args, "--entrypoint", "tests.targets:dump_env", out=out)
    assert code == 0, capsys.readouterr().err[-3000:]
    seen = [json.loads(f.read_text())["env"] for f in sorted(out.glob("env-rank*.json"))]
    assert len(seen) == 2 and {e["MASTER_PORT"] for e in seen} == {str(port)}
    assert leftovers("reuseport") == ([], [])


def test_port_reservations_are_exclusive_across_jobs():
    from launcher.driver.gang.gang import ports

    assert ports.reserve("10.9.9.9", [21001, 21002], "job-a") == 21001
    assert ports.reserve("10.9.9.9", [21001, 21002], "job-b") == 21002
    assert ports.reserve("10.9.9.9", [21001, 21002], "job-c") is None
    ports.release("10.9.9.9", 21001)
    assert ports.reserve("10.9.9.9", [21001, 21002], "job-c") == 21001


@pytest.mark.parametrize("profile", ["efa", "infiniband", "tcp", "cpu"])
def test_each_env_profile_reaches_every_rank(profile, tmp_path):
    from launcher.core.profiles import load_profile

    out = tmp_path / "out"
    assert launch(f"profile-{profile}", "--device", "cpu", "--gpus-per-node", "2", "--env-profile", profile,
                  "--entrypoint", "tests.targets:dump_profile", out=out) == 0  # fmt: skip
    want = load_profile(profile)
    for seen in read_ranks(out, "profile", 2):
        assert {k: seen[k] for k in want} == want


def test_the_torchrun_example_runs_unchanged(capfd):
    assert launch("example", "--device", "cpu", "--gpus-per-node", "2", "examples/torchrun_script.py",
                  "--steps", "2") == 0  # fmt: skip


def test_runs_dir_that_is_a_file_exits_2_at_once(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    assert launch("runsfile", "--runs-dir", str(blocker), "--dry-run") == 2
    err = capsys.readouterr().err
    assert f"--runs-dir {blocker} cannot hold run directories (a file is in the way)" in err
    assert "Traceback" not in err


def test_a_running_jobs_name_is_refused_and_run_directories_are_never_shared(tmp_path, capsys):
    from launcher import RankGroup

    runs = ["--runs-dir", str(tmp_path), "--device", "cpu", "--entrypoint", "tests.targets:whoami"]
    with RankGroup(device="cpu", job_name="dupname"):
        assert launch("dupname", *runs) == 2
        err = capsys.readouterr().err
        assert "job name dupname is in use on this cluster (placement group dupname-node0 exists)" in err
    assert launch("dupname", *runs) == 0
    assert launch("dupname", *runs) == 0
    first, second = tmp_path / "dupname", tmp_path / "dupname.1"
    assert json.loads((first / "summary.json").read_text())["status"] == "error"  # the refused launch
    assert json.loads((second / "summary.json").read_text())["status"] == "succeeded"
    assert (tmp_path / "dupname.2" / "summary.json").exists()
    # each rank's whole environment is in there: private to the user
    assert (second.stat().st_mode & 0o777, (second / "env.json").stat().st_mode & 0o777) == (0o700, 0o600)
    assert leftovers("dupname") == ([], [])


EXIT_PROBE = """
import atexit, os, sys, threading, time
out, rank = sys.argv[1], os.environ["RANK"]

def later():
    time.sleep(2)
    open(os.path.join(out, f"thread-{rank}"), "w").write("done")

threading.Thread(target=later).start()  # non-daemon: the interpreter waits for it at exit
atexit.register(lambda: open(os.path.join(out, f"atexit-{rank}"), "w").write("done"))
atexit.register(print, f"rank {rank} says goodbye from atexit")
"""


@pytest.mark.slow  # seconds of waiting or many ranks: out of the fast loop
def test_ranks_end_like_processes_atexit_and_threads_run_as_under_torchrun(tmp_path, capsys):
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(EXIT_PROBE)
    for launcher in ("torchrun", "megaray"):
        out = tmp_path / launcher
        out.mkdir()
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
            assert subprocess.run([*cmd, str(script), str(out)], capture_output=True).returncode == 0
        else:
            args = [
                "--device",
                "cpu",
                "--gpus-per-node",
                "2",
                "--runs-dir",
                str(tmp_path),
                str(script),
                str(out),
            ]
            assert launch("exitprobe", *args) == 0
        assert sorted(p.name for p in out.iterdir()) == ["atexit-0", "atexit-1", "thread-0", "thread-1"], (
            launcher
        )
    # what the handlers print on the way out reaches the rank's log, as torchrun's console shows it
    assert "rank 1 says goodbye from atexit" in (tmp_path / "exitprobe" / "rank-1.log").read_text()
    assert leftovers("exitprobe") == ([], [])


STORE_PROBE = """
import json, os, sys, time
from datetime import timedelta
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if rank == 0:
    time.sleep(1.5)  # rank 0 late: the others reach the store before its program has imported torch
import torch, torch.distributed as dist
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # env://: the launcher's store
# as older scripts do: their own master store on MASTER_PORT (under torchrun, the agent's store)
own = dist.TCPStore(addr, port, world, rank == 0, timedelta(seconds=60))
own.set(f"hello{rank}", str(rank))
dist.barrier()
t = torch.ones(1)
dist.all_reduce(t)
seen = {"said": [own.get(f"hello{r}").decode() for r in range(world)], "sum": t.item(),
        "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}
json.dump(seen, open(os.path.join(sys.argv[1], f"rank{rank}"), "w"))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow  # seconds of waiting or many ranks: out of the fast loop
def test_the_store_is_served_before_programs_start_and_shared_as_torchrun_s_agent_store(tmp_path):
    """Ranks that reach the rendezvous before rank 0's program has imported torch are served once it
    has, and a program's own master store on MASTER_PORT joins that store: torchrun's agent store."""
    import subprocess
    import sys

    script = tmp_path / "store_probe.py"
    script.write_text(STORE_PROBE)
    seen = {}
    for launcher in ("torchrun", "megaray"):
        out = tmp_path / launcher
        out.mkdir()
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
            p = subprocess.run([*cmd, str(script), str(out)], capture_output=True, text=True)
            assert p.returncode == 0, p.stderr[-3000:]
        else:
            args = ["--device", "cpu", "--gpus-per-node", "2", "--runs-dir", str(tmp_path), str(script)]
            assert launch("storeprobe", *args, str(out)) == 0
        seen[launcher] = [json.loads((out / f"rank{r}").read_text()) for r in range(2)]
    assert seen["megaray"] == seen["torchrun"]
    assert seen["megaray"][1] == {"said": ["0", "1"], "sum": 2.0, "agent_store": "True"}
    assert leftovers("storeprobe") == ([], [])


def test_a_process_still_exiting_after_the_grace_is_killed_and_named(tmp_path, capsys):
    script = tmp_path / "stuck.py"
    script.write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()\n")
    t0 = time.monotonic()
    args = ["--device", "cpu", "--exit-grace", "1", "--runs-dir", str(tmp_path), str(script)]
    assert launch("exitstuck", *args) == 0
    assert time.monotonic() - t0 < 60
    err = capsys.readouterr().err
    assert "rank(s) 0 still running 1s after the program returned (thread Thread-1 (sleep)): killed" in err
    assert leftovers("exitstuck") == ([], [])


STOP_PROBE = """
import os, signal, sys, time
out, rank = sys.argv[1], int(os.environ["RANK"])
if rank == 1:  # fails once rank 0 is ready for the SIGTERM that follows (its handler installed)
    deadline = time.time() + 60
    while not os.path.exists(os.path.join(out, "pid")) and time.time() < deadline:
        time.sleep(0.1)
    raise SystemExit(3)
if len(sys.argv) > 2:  # a handler of its own, as Megatron-Bridge's checkpoint-on-SIGTERM
    def handler(signum, frame):
        with open(os.path.join(out, "handled"), "a") as f:  # once: appended if it ran again
            f.write(f"{signum}\\n")
        sys.exit(143)
    signal.signal(signal.SIGTERM, handler)
open(os.path.join(out, "pid"), "w").write(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.parametrize("own_handler", [False, True])
def test_surviving_ranks_get_sigterm_before_the_kill(tmp_path, capsys, own_handler):
    script = tmp_path / "stop.py"
    script.write_text(STOP_PROBE)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--device", "cpu", "--gpus-per-node", "2", "--runs-dir", str(tmp_path), str(script), str(out)]
    assert launch("stopprobe", *args, *(["handler"] if own_handler else [])) == 1
    assert "exited with code 3" in capsys.readouterr().err
    assert (out / "handled").exists() == own_handler  # the program's own handler ran before the kill
    if own_handler:
        assert (out / "handled").read_text() == f"{int(signal.SIGTERM)}\n"  # once, not again into the kill
    assert leftovers("stopprobe") == ([], [])


def test_more_ranks_than_the_forwarder_takes_calls_at_once_still_print_and_stop(tmp_path):
    """Every rank keeps a stop wait pending on its node's forwarder. Here the forwarder's default group
    takes 2 calls at once (a launch's takes Ray's 1,000) and 6 ranks wait: their output must still
    reach the sink and their stop still be delivered, as for a node of many ranks (the waits have
    their own group)."""
    from launcher.driver.output.relay import _forwarder_class, start_sink

    world = 6
    sink = start_sink("many-ranks-sink").remote(str(tmp_path), [0] * world, frozenset(range(world)))
    forwarder = _forwarder_class().options(max_concurrency=2).remote(sink, frozenset(range(world)), 1)

    @ray.remote(num_cpus=0)
    class Rank:
        def start(self, forwarder, rank: int, spool: str) -> int:
            from launcher.rank.capture import Capture

            self.capture = Capture(forwarder, rank, spool)
            return os.getpid()

        def say(self, text: str) -> None:
            print(text, flush=True)
            self.capture.sync()

    ranks = [Rank.remote() for _ in range(world)]
    try:
        ray.get(
            [r.start.remote(forwarder, i, str(tmp_path / f"spool-{i}")) for i, r in enumerate(ranks)],
            timeout=60,
        )
        ray.get([r.say.remote(f"hello from rank {i}") for i, r in enumerate(ranks)], timeout=30)
        lines, _, _ = ray.get(sink.drain.remote(), timeout=10)
        assert sorted(lines) == [(1, f"[r{i} n0] hello from rank {i}") for i in range(world)]  # stdout
        ray.get(forwarder.stop_ranks.remote(), timeout=10)
        deadline = time.monotonic() + 30
        alive = list(ranks)
        while alive and time.monotonic() < deadline:  # each rank sent itself SIGTERM
            alive = [r for r in alive if not _dead(r)]
        assert not alive, f"{len(alive)} of {world} ranks were not stopped"
    finally:
        for actor in [*ranks, forwarder, sink]:
            ray.kill(actor)


def _dead(actor) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=1)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return True
    return False


def test_a_slow_sink_slows_the_sending_not_the_program_and_loses_nothing(tmp_path):
    """Two ranks flood a sink that takes half a second a call, through their node's forwarder: one
    batch in flight for the node, one write in flight per rank, the rest waits in the spools and goes
    in the next batch; every line reaches each rank's log."""
    from launcher.driver.output.relay import OutputSink, _forwarder_class

    class SlowSink(OutputSink):
        calls = 0

        def take(self, batch) -> None:
            self.calls += 1
            time.sleep(0.5)
            super().take(batch)

        def taken(self) -> int:
            return self.calls

    sink = ray.remote(SlowSink).remote(str(tmp_path), [0, 0], frozenset())
    forwarder = _forwarder_class().remote(sink, frozenset(), 1)

    @ray.remote(num_cpus=0)
    class Rank:
        def flood(self, forwarder, rank: int, spool: str, seconds: float) -> int:
            from launcher.rank.capture import Capture

            capture = Capture(forwarder, rank, spool)
            lines, end = 0, time.monotonic() + seconds
            while time.monotonic() < end:
                print(f"line {lines}", flush=True)
                lines += 1
            capture.sync(timeout_s=30)
            return lines

    ranks = [Rank.remote() for _ in range(2)]
    try:
        t0 = time.monotonic()
        counts = ray.get(
            [r.flood.remote(forwarder, i, str(tmp_path / f"spool-{i}"), 2.0) for i, r in enumerate(ranks)],
            timeout=90,
        )
        took = time.monotonic() - t0
        calls = ray.get(sink.taken.remote(), timeout=10)
        assert calls <= took / 0.5 + 1, f"{calls} calls in {took:.1f} s to a sink taking 0.5 s each"
        ray.get(sink.finish.remote(), timeout=10)
        for rank, lines in enumerate(counts):
            logged = (tmp_path / f"rank-{rank}.log").read_text().splitlines()
            assert len(logged) == lines and logged[-1] == f"[r{rank} n0] line {lines - 1}"
    finally:
        for actor in [*ranks, forwarder, sink]:
            ray.kill(actor)


@pytest.mark.slow  # seconds of waiting or many ranks: out of the fast loop
@pytest.mark.alone  # it makes the machine busy on purpose
def test_a_busy_machine_and_a_stopped_rank_are_not_a_lost_node(out, capsys):
    """megaray's own node probes (a TCP connection to the raylet) are answered by the kernel, whatever
    the ranks do: all CPUs busy, a C call holding the GIL, a long checkpoint write, a first
    torch.compile (both ranks building C++ at once), a rank stopped, each for longer than a silent
    node is allowed."""
    assert launch("notlost", "--device", "cpu", "--gpus-per-node", "2", "--entrypoint",
                  "tests.targets:busy_then_frozen", out=out) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "was lost" not in err and "no answer" not in err
    if shutil.which("g++") or shutil.which("c++"):  # inductor needs one: where none, no compile ran
        compiled = {p.name: float(p.read_text()) for p in out.glob("compiled-*")}
        assert sorted(compiled) == ["compiled-0", "compiled-1"] and min(compiled.values()) > 5, compiled
    assert leftovers("notlost") == ([], [])


@pytest.mark.slow  # seconds of waiting or many ranks: out of the fast loop
@pytest.mark.alone  # it makes the machine busy on purpose
def test_sixteen_ranks_importing_torch_on_two_cores_are_not_a_lost_node(tmp_path, capsys):
    """The machine at 100% for half a minute: 16 ranks starting Ray workers, importing torch and
    joining gloo on 2 cores (bench/barrier.py, unchanged). The node's raylet port is answered by the
    kernel all the same: megaray's probes hear it, and the job ends well."""
    done = tmp_path / "barrier"
    done.mkdir()
    assert launch("busy16", "--device", "cpu", "--gpus-per-node", "16", "--cpus-per-rank", "0.25",
                  str(REPO / "bench" / "barrier.py"), "--out", str(done)) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "was lost" not in err and "no answer" not in err
    assert len(list(done.iterdir())) == 16  # every rank past the barrier
    assert leftovers("busy16") == ([], [])
