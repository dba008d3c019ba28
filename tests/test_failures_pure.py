"""Tier 1, with no process started: failure reports: root cause, deaths, signals, error files
(core/deaths.py, core/errors.py)."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.cli import main
from launcher.core.deaths import death_cause, describe_death, readable_tail
from launcher.core.errors import RankFailedError, RankFailure
from launcher.core.placing import nodes_that_fit, without_autoscaler


def test_root_cause_is_the_earliest_failure_and_the_report_shows_its_traceback():
    late = RankFailure(0, "10.0.0.1", "h0", "0", "exception", "RuntimeError: peer closed", "tb0", at=2.0)
    first = RankFailure(
        5, "10.0.0.2", "h1", "1", "exception", "ValueError: bad", "Traceback...\nValueError: bad", at=1.0
    )
    err = RankFailedError([late, first], world_size=8)
    assert err.root is first
    assert str(err) == "rank 5 on 10.0.0.2 (h1) failed: ValueError: bad"
    report = err.report()
    assert "rank      : 5 of 8" in report and "    ValueError: bad" in report
    assert "rank 0 on 10.0.0.1: RuntimeError: peer closed" in report
    died = RankFailure(3, "10.0.0.2", "h1", "3", "died", "its process exited unexpectedly", at=3.0)
    assert RankFailedError([late, died], world_size=8).root is died  # peers' connection errors come first


def test_a_hang_with_a_stopped_rank_waits_no_kill_grace_for_it():
    """A SIGSTOPped (or zombie, or D-state) rank cannot act on SIGTERM: the teardown did wait out
    --kill-grace for it (hang to exit 7 s instead of 3.5 s past --hang-timeout 3)."""
    stopped = RankFailure(1, "10.0.0.2", "h1", "-", "hung", "no output; process stopped (SIGSTOP)", at=1.0)
    waiting = RankFailure(0, "10.0.0.1", "h0", "-", "waiting", "no output; process sleeping", at=1.0)
    assert RankFailedError([waiting, stopped], world_size=2).beyond_signals() == {1}
    # a rank seen dying (its process may still give back GPU memory for seconds): no grace either
    died = RankFailure(2, "10.0.0.2", "h1", "-", "died", "its process was killed by SIGKILL", at=1.0)
    assert RankFailedError([waiting, died], world_size=3).beyond_signals() == {2}


def test_a_node_lost_while_its_ranks_start_fails_those_ranks_as_died_naming_the_node():
    from launcher.core.topology import RankSlot
    from launcher.driver.supervision.rank_ends import lost_while_starting, silent

    slots = [RankSlot(r, r % 2, r // 2, r // 2, r % 2, f"10.0.0.{r // 2}", f"node{r // 2}", f"h{r // 2}")
             for r in range(4)]  # fmt: skip
    err = lost_while_starting(
        slots, {"node1": silent(4.2, "no answer within 1s", " while its ranks started")}
    )
    assert [(f.rank, f.kind, f.node_ip) for f in err.failures] == [
        (2, "died", "10.0.0.1"),
        (3, "died", "10.0.0.1"),
    ]
    assert err.world_size == 4
    assert str(err) == (
        "rank 2 on 10.0.0.1 (h1) failed: its node 10.0.0.1 (node id node1) was lost: no answer from it for "
        "4s while its ranks started (no answer within 1s: a cut link or a dead machine); it took rank(s) 2-3 "
        "with it"
    )


def test_the_report_names_what_torchrun_names_of_the_root_cause():
    """torchrun's root cause: time, host, rank and local rank, exit code and pid, the error file."""
    import time

    at = time.mktime((2026, 11, 24, 13, 29, 27, 0, 0, -1))
    f = RankFailure(1, "10.0.0.2", "h1", "1", "exception", "ValueError: bad", "tb", exit_code=1, at=at,
                    local_rank=1, pid=4242, error_file="/logs/rank1-error.json")  # fmt: skip
    report = RankFailedError([f], world_size=2).report()
    for line in ("rank      : 1 of 2", "local rank: 1", "pid       : 4242", "time      : 2026-11-24_13:29:27",
                 "exit code : 1", "error file: /logs/rank1-error.json (on 10.0.0.2)"):  # fmt: skip
        assert f"\n  {line}\n" in report, report
    from launcher.cli.jobspec import root_cause

    assert root_cause(report) == "rank 1 of 2 on 10.0.0.2 (h1): ValueError: bad"


def test_the_error_file_is_read_as_torchrun_reads_it():
    import json

    from launcher.core.errorfile import RecordedError, parse_error_file

    extra = {"py_callstack": "Traceback...", "timestamp": "1795000000"}  # as torch writes it
    written = {"message": {"message": "ValueError: bad", "extraInfo": extra}}
    assert parse_error_file(json.dumps(written)) == RecordedError(
        "ValueError: bad", "Traceback...", 1_795_000_000
    )
    assert parse_error_file(json.dumps({"message": "by hand"})) == RecordedError("by hand")
    assert parse_error_file('{"message": {"mess') is None and parse_error_file("[1]") is None


def test_describe_death_keeps_what_ray_knows():
    sigkill = (
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
        "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes"
    )
    assert describe_death(sigkill) == (
        "its process exited unexpectedly (a signal such as SIGKILL, the kernel OOM killer, or a crash); "
        "Ray: Worker unexpectedly exits with a connection error code 2."
    )
    assert describe_death("The actor died because its node has died. Node Id: ab").startswith(
        "its node was lost"
    )
    assert describe_death("Task was killed due to the node running low on memory.").startswith(
        "killed by Ray's"
    )


SEGV_OUTPUT = [
    "step 41",
    "*** SIGSEGV received at time=1795441594 on cpu 1 ***",
    "PC: @     0x7f7a48585ad8  (unknown)  (unknown)",
    "[2026-11-23 13:46:34,076 E 22645 22645] logging.cc:474: *** SIGSEGV received at time=1795441594 ***",
    "Fatal Python error: Segmentation fault",
    "",
    "Stack (most recent call first):",
    '  File "/usr/lib/python3.12/ctypes/__init__.py", line 525 in string_at',
    '  File "/home/u/train.py", line 8 in <module>',
    '  File "<frozen runpy>", line 88 in _run_code',
    '  File "/venv/lib/python3.12/site-packages/launcher/rank/actor.py", line 214 in run_target',
    '  File "/venv/lib/python3.12/site-packages/ray/_private/worker.py", line 1069 in main_loop',
    "",
    "Extension modules: msgpack._cmsgpack, ray._raylet (total: 2)",
]


def test_a_dead_rank_s_signal_is_read_from_its_last_output_or_its_node():
    assert death_cause(SEGV_OUTPUT, 0).startswith("its process was killed by SIGSEGV (segmentation fault")
    assert death_cause(["Fatal Python error: Aborted"], None).startswith("its process was killed by SIGABRT")
    assert death_cause(["*** SIGBUS received at time=1 ***"], None).startswith(
        "its process was killed by SIGBUS "
    )
    assert "the kernel's OOM killer killed 1 process(es) on its node" in death_cause(["step 3"], 1)
    assert "os._exit(), or a signal sent from outside the job" in death_cause(["step 3"], 0)
    assert death_cause(["step 3"], None) is None  # no /proc/vmstat: nothing known
    assert readable_tail(SEGV_OUTPUT) == (
        "step 41",
        "Fatal Python error: Segmentation fault",
        "",
        "Stack (most recent call first):",
        '  File "/usr/lib/python3.12/ctypes/__init__.py", line 525 in string_at',
        '  File "/home/u/train.py", line 8 in <module>',
    )


def test_a_cluster_without_an_autoscaler_is_told_by_its_node_types():
    readonly = {"autoscaler_report": {"node_type_mapping": {"ab12": "node_ab12", "cd34": "node_cd34"}}}
    scaling = {"autoscaler_report": {"node_type_mapping": {"ab12": "head", "cd34": "gpu_worker"}}}
    assert without_autoscaler(readonly) is True
    assert without_autoscaler(scaling) is False
    assert without_autoscaler(None) is None and without_autoscaler({"autoscaler_report": {}}) is None


def test_nodes_that_fit_counts_whole_groups():
    totals = {"a": {"GPU": 8, "CPU": 96}, "b": {"GPU": 4, "CPU": 96}, "c": {"CPU": 8}}
    assert nodes_that_fit(totals, {"GPU": 1, "CPU": 1}, 8) == 1
    assert nodes_that_fit(totals, {"GPU": 1, "CPU": 1}, 4) == 2
    assert nodes_that_fit(totals, {"CPU": 2}, 4) == 3


def test_unknown_entrypoint_and_unreachable_address_exit_2(capsys):
    assert main(["--entrypoint", "no_such_pkg.train:main"]) == 2
    assert "no module named no_such_pkg.train" in capsys.readouterr().err
    assert main(["--address", "127.0.0.1:1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach a Ray cluster at 127.0.0.1:1" in err and "--address" in err


def test_an_address_that_is_not_rays_gcs_is_refused_in_seconds(tmp_path, capsys):
    import http.server
    import threading
    import time

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        args = ["--address", f"127.0.0.1:{server.server_port}", "--dry-run", "--runs-dir", str(tmp_path)]
        assert main(args) == 2
        assert time.monotonic() - t0 < 10  # not Ray's retry loop (about 14 minutes)
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert (
        f"127.0.0.1:{server.server_port} answers, but as" in err
        and "not as Ray's GCS" in err
        and "GCS port" in err
    )


def test_node_versions_must_match_the_driver():
    import sys

    import ray

    from launcher.core.errors import ClusterError
    from launcher.core.topology import RankReport
    from launcher.driver.cluster.cluster import check_versions

    py = ".".join(map(str, sys.version_info[:3]))
    same = RankReport(0, "10.0.0.1", "n1", "a", 1, (), ray.__version__, py, {})
    check_versions([same, same])
    other = dataclasses.replace(
        same, node_ip="10.0.0.2", hostname="b", ray_version="2.59.0", python_version="3.12.9"
    )
    with pytest.raises(ClusterError) as err:
        check_versions([same, other])
    assert str(err.value) == (
        f"node versions differ from the driver's (Ray {ray.__version__}, Python {py}): "
        "10.0.0.2 (b): Ray 2.59.0, Python 3.12.9; "
        "install the same Ray and Python on every node and the driver"
    )
    assert err.value.exit_code == 2


def test_a_crash_in_ray_s_own_teardown_is_told_from_the_program_s():
    from launcher.core.deaths import ray_teardown_crash

    ray_s = [
        "[mutex.cc : 452] RAW: Lock blocking 0x5604d1504610   @ 0x7f9d28c51712 0x7f9d27d0176c",
        "[mutex.cc : 1957] RAW: Check (v & (kMuWait | kMuWrWait)) != kMuWrWait failed: Lock: Mutex corrupt",
        "Fatal Python error: Aborted",
    ]
    program_s = ["rank 1 returning", "Fatal Python error: Aborted", "", "Stack (most recent call first):"]
    assert ray_teardown_crash(ray_s) and not ray_teardown_crash(program_s)


STAT_RUNNING = "4242 (ray::RankActor.run (x)) S 1 4242 4242 0 -1 4194560 " + " ".join(["0"] * 44)


def _stat(state: str, flags: int, code: int) -> str:
    fields = STAT_RUNNING.split(") ", 1)[1].split()
    fields[0], fields[6] = state, str(flags)
    return "4242 (ray::RankActor.run (x)) " + " ".join([*fields[:49], str(code)])


def test_a_process_is_seen_ending_by_its_exit_flag_zombie_state_or_pending_sigkill():
    """A rank's process with GPU memory takes seconds to exit after SIGKILL (5.4 s on an H100), and Ray
    reports it dead only after that: its node sees it as it starts to (core/deaths.py process_end)."""
    from launcher.core.deaths import PF_EXITING, ProcessEnd, process_end

    assert process_end(4242, _stat("S", 0x400100, 0), "SigPnd:\t0000000000000000\n") is None
    killed = process_end(4242, _stat("R", 0x400100 | PF_EXITING, 9), None)
    assert killed == ProcessEnd(4242, 9) and killed.exit_code == -9 and not killed.clean
    assert killed.describe() == "its process was killed by SIGKILL (signal 9)"
    exited = process_end(4242, _stat("Z", 0x400100, 7 << 8), None)
    assert exited.exit_code == 7 and "exited with code 7 (os._exit" in exited.describe()
    assert process_end(4242, _stat("Z", 0, 0), None).clean  # os._exit(0): not a failure, as under torchrun
    pending = "SigPnd:\t0000000000000000\nShdPnd:\t0000000000000100\n"  # the kill is on its way
    assert process_end(4242, _stat("D", 0x400100, 0), pending) == ProcessEnd(4242, 9)
    assert process_end(4242, None, None) == ProcessEnd(4242, None)  # gone before it was read
    # what the driver counts as a failure as soon as the node sees it: not os._exit(0); a process Ray
    # reaped before the look (within milliseconds of a SIGKILL) vanished, and is one unless its exit
    # mark says os._exit(0) (driver/supervision/rank_ends.py): Ray tells it only when the children the
    # rank forked let go of its socket (5 s for torch's DataLoader workers)
    assert killed.failed and exited.failed and not process_end(4242, _stat("Z", 0, 0), None).failed
    assert not ProcessEnd(4242, None).failed and ProcessEnd(4242, None).vanished
    assert not (killed.vanished or exited.vanished)
    assert process_end(4242, "garbage", None) is None
    # the report says what its node saw, and whether the kernel's OOM killer was at work
    assert death_cause(["step 3"], 0, killed).startswith(
        "its process was killed by SIGKILL (signal 9), not by the kernel's OOM killer: a signal sent from "
        "outside the job"
    )
    assert "OOM killer killed 2 process(es)" in death_cause(["step 3"], 2, killed)
    assert death_cause(SEGV_OUTPUT, 0, killed).startswith("its process was killed by SIGSEGV")
    assert death_cause(["step 3"], 0, ProcessEnd(1, None)).startswith("its process ended without")


def test_a_spare_starts_beside_its_dying_rank_only_when_the_gpu_has_room_for_what_the_rank_used():
    from launcher.rank.gpu_room import room_problem

    gib = 2**30
    assert room_problem(int(4.4 * gib), 70 * gib, 0) is None  # the H100 restart model: room at once
    assert "GiB free of the" in room_problem(40 * gib, 40 * gib, 0)  # a big model: wait for the memory
    assert "one process at a time" in room_problem(gib, 70 * gib, 3)  # EXCLUSIVE_PROCESS
    assert "not seen" in room_problem(None, 70 * gib, 0)


def test_a_dying_rank_s_megabyte_line_is_shortened_in_the_report():
    line = "x" * 5_000_000 + "the end"
    (shown,) = readable_tail(["step 3", line])[-1:]
    assert len(shown) < 1_400 and shown.startswith("x" * 1000) and shown.endswith("the end")
    assert "[... 4998807 characters left out: the rank's log has the line ...]" in shown
    assert readable_tail(["short", "y" * 1300]) == ("short", "y" * 1300)  # under the bound: whole


def test_a_local_ray_that_did_not_come_up_in_time_is_one_line():
    """Ray raises a bare Exception when the raylet it started has not registered within its 30 s (on 2
    cores beside the test suite, its agents' starts took that long): one line with what to do, not
    Ray's traceback."""
    import inspect

    import ray._private.node

    from launcher.core.errors import ClusterError
    from launcher.driver.cluster import cluster

    assert cluster.RAY_START_TIMED_OUT in inspect.getsource(ray._private.node)  # Ray's words still
    with pytest.raises(ClusterError) as caught, cluster._started_in_time():
        raise Exception(cluster.RAY_START_TIMED_OUT + ". This could happen because ...")
    said = str(caught.value)
    assert said.startswith("the local Ray did not start: its node did not come up within Ray's 30 s")
    assert "--address" in said and "/ray/session_latest/logs)" in said and "\n" not in said
    busy = cluster.start_timed_out(13.2, 2, "/tmp/ray")
    assert "this machine is busy (load 13.2 on 2 core(s)): try again" in busy
    assert "busy" not in cluster.start_timed_out(0.5, 2, "/tmp/ray")
    with pytest.raises(ValueError), cluster._started_in_time():  # anything else is not this
        raise ValueError("other")
