"""Tier 2: ranks that fail on one Ray node started in this process (`main()` in-process): a raise,
an exit code, a kill, a signal, several at once, a dead forwarder, stops and exit graces, os._exit(0)
and report(); each named as torchrun would, with its last output, and nothing left behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import threading
import time

import pytest
import ray

from .conftest import REPO, documented_fields, launch, leftovers

pytestmark = pytest.mark.usefixtures("one_node")


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


@pytest.mark.slow  # the full suite runs it; the fast loop (2 minutes) launches this way elsewhere
def test_ranks_failing_together_are_all_listed(out, tmp_path, capsys):
    """#45 item 5: four ranks raising together reach the driver at their own pace, some after the
    first failure's window: the report named 2 of 4 now and then. Every rank that failed before the
    stop reached it is listed, the root cause first, as torchrun lists every failed worker. (Once, 3
    of 4 on a loaded machine: the driver compared its clock with the ranks', and the last one's
    failure, 0.2 s after the others', came after the stop had begun. Each rank tells now.)"""
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
    """Each rank has forked a child that holds its sockets, as DataLoader workers do: Ray reports a
    rank's death only once its child lets go (5 s for torch's workers, CHILD_HOLDS_S here). Rank 1 is
    SIGKILLed; the node's watch tells it, whether it catches the process exiting or finds it already
    reaped, and tells rank 0's end on the stop's SIGTERM too, however long --kill-grace would let it
    take: the launch has ended before either child let go (the teardown's kill of each actor kills
    its process group)."""
    import psutil

    from .targets import CHILD_HOLDS_S

    children: list[psutil.Process] = []

    def kill_rank_1():
        wanted = [out / f"{name}-rank{r}.json" for name in ("pid", "child") for r in (0, 1)]
        deadline = time.monotonic() + 60
        while not all(f.exists() for f in wanted) and time.monotonic() < deadline:
            time.sleep(0.05)
        children.extend(
            psutil.Process(json.loads((out / f"child-rank{r}.json").read_text())["pid"]) for r in (0, 1)
        )
        os.kill(json.loads((out / "pid-rank1.json").read_text())["pid"], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    code = launch(
        "sigkill",
        "--device",
        "cpu",
        "--gpus-per-node",
        "2",
        "--kill-grace",
        str(2 * CHILD_HOLDS_S),
        "--entrypoint",
        "tests.targets:wait_forever_with_a_child",
        out=out,
    )
    let_go = sorted(f.name for f in out.glob("let-go-rank*.json"))
    for child in children:
        with contextlib.suppress(psutil.Error):  # the same process (psutil compares its start time)
            child.kill()  # killed with its rank's process group by the teardown, as a rule
    assert code == 1  # how fast: bench/failures.py's "rank death", against torchrun (not a timed assert)
    assert let_go == [], f"the launch waited for Ray's report, sent as a child let go ({CHILD_HOLDS_S} s)"
    err = capsys.readouterr().err
    # whichever told first: the node (as the process started to exit, or found it reaped) or Ray
    assert "rank      : 1 of 2" in err and "SIGKILL" in err and "a signal sent from outside the job" in err
    assert leftovers("sigkill") == ([], [])


@pytest.mark.slow  # the full suite runs it; the fast loop (2 minutes) launches this way elsewhere
def test_a_dead_forwarder_ends_the_job_in_seconds_saying_so_not_as_a_hang(out, capsys):
    """#46: the node's output forwarder SIGKILLed while the ranks run (they print and would wait on it):
    the attempt ends within seconds, naming the forwarder, instead of at --hang-timeout as silent."""
    from ray.util.state import list_actors

    from .conftest import connected

    killed = []

    def kill_the_forwarder():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            # one node, the driver's: its forwarder holds the sink too (driver/output/sink_host.py)
            mine = [("class_name", "=", "SinkForwarder"), ("state", "=", "ALIVE")]
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
    assert set(summary) <= documented_fields("summary.json"), summary.keys()  # docs/reference
    topology = json.loads((runs / "exitzero" / "topology.json").read_text())
    assert set(topology) <= documented_fields("topology.json"), topology.keys()
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


@pytest.mark.parametrize("how", ["segv", pytest.param("exit", marks=pytest.mark.slow)])
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


@pytest.mark.parametrize("own_handler", [pytest.param(False, marks=pytest.mark.slow), True])
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
    # rank 0's end (its handler's exit 143, or the signal's) was the stop's doing: not a failure of its own
    failed = json.loads((tmp_path / "stopprobe" / "summary.json").read_text())["failures"]
    assert [f["rank"] for f in failed] == [1], failed
    assert leftovers("stopprobe") == ([], [])


@pytest.mark.slow  # seconds of waiting or many ranks: out of the fast loop
@pytest.mark.alone(busy=True)  # it makes the machine busy on purpose: the others are not lowered
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
@pytest.mark.alone(busy=True)  # it makes the machine busy on purpose: the others are not lowered
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
