"""Tier 1: the decisions, with no process started (no Ray, no torch.distributed)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from launcher.cli import main
from launcher.core.deaths import death_cause, describe_death, readable_tail
from launcher.core.errors import RankFailedError, RankFailure, UsageError
from launcher.core.profiles import available_profiles, load_profile
from launcher.core.rankenv import CONTRACT_KEYS, contract_env, decide_env, parse_env_pairs
from launcher.core.recipes import load_recipe
from launcher.core.spec import LaunchSpec, spec_from_args
from launcher.core.target import DRY_RUN_TARGET, Target, check_target_locally
from launcher.core.topology import (
    NodeSlot,
    assign_ranks,
    candidate_ports,
    format_rank_ranges,
    order_nodes,
    visible_devices,
)
from launcher.driver.placement import nodes_that_fit, without_autoscaler
from launcher.driver.targets import runner_for
from launcher.rank.probes import wait_gone
from launcher.rank.warmup import warm

# What torchrun exports to each worker (torch/distributed/elastic/agent/server/local_elastic_agent.py),
# less the error-file and signal variables that only its own agent reads.
TORCHRUN_KEYS = {
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
}  # fmt: skip


# -- node order and ranks ---------------------------------------------------------------------------
def test_ips_sort_numerically_not_as_strings():
    nodes = [
        NodeSlot(0, "10.0.0.10", "a"),
        NodeSlot(1, "10.0.0.9", "b"),
        NodeSlot(2, "10.0.0.100", "c"),
        NodeSlot(3, "9.1.1.1", "d"),
    ]
    assert [n.node_ip for n in order_nodes(nodes)] == ["9.1.1.1", "10.0.0.9", "10.0.0.10", "10.0.0.100"]


def test_same_ip_breaks_ties_by_node_id_and_hostnames_go_last():
    nodes = [
        NodeSlot(0, "127.0.0.1", "ff"),
        NodeSlot(1, "node-b", "00"),
        NodeSlot(2, "127.0.0.1", "0a"),
        NodeSlot(3, "::1", "11"),
    ]
    assert [(n.node_ip, n.node_id) for n in order_nodes(nodes)] == [
        ("127.0.0.1", "0a"),
        ("127.0.0.1", "ff"),
        ("::1", "11"),
        ("node-b", "00"),
    ]


def test_ranks_are_contiguous_per_node_in_node_order():
    slots = assign_ranks(order_nodes([NodeSlot(0, "10.0.0.2", "x"), NodeSlot(1, "10.0.0.1", "y")]), 3)
    assert [(s.rank, s.node_rank, s.local_rank, s.group, s.bundle) for s in slots] == [
        (0, 0, 0, 1, 0),
        (1, 0, 1, 1, 1),
        (2, 0, 2, 1, 2),
        (3, 1, 0, 0, 0),
        (4, 1, 1, 0, 1),
        (5, 1, 2, 0, 2),
    ]
    assert {s.node_ip for s in slots[:3]} == {"10.0.0.1"}


def test_visible_devices_lets_local_rank_select_the_ray_gpu():
    ids = [["3"], ["1"], ["6"]]  # what Ray gave the ranks of one node, by local rank
    cvd = visible_devices(ids)
    assert cvd == "3,1,6"
    for local_rank, own in enumerate(ids):
        assert cvd.split(",")[local_rank] == own[0]


def test_visible_devices_rejects_inconsistent_assignments():
    assert visible_devices([[], []]) == ""
    with pytest.raises(ValueError, match="same GPU"):
        visible_devices([["0"], ["0"]])
    with pytest.raises(ValueError, match="expected one"):
        visible_devices([["0", "1"]])
    with pytest.raises(ValueError, match="1 of 2 ranks"):
        visible_devices([["0"], []])


def test_format_rank_ranges():
    assert format_rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


# -- ports ----------------------------------------------------------------------------------------
def test_port_candidates_depend_on_the_job_and_avoid_the_ephemeral_range():
    a = list(candidate_ports("job-a", 20000, 20100, exclude=(20050, 20099)))
    assert sorted(a) == list(range(20000, 20050))
    assert a == list(candidate_ports("job-a", 20000, 20100, exclude=(20050, 20099)))
    assert a != list(candidate_ports("job-b", 20000, 20100, exclude=(20050, 20099)))


# -- env ----------------------------------------------------------------------------------------
def _contract(rank=1, local_rank=1, node_rank=0):
    slot = assign_ranks([NodeSlot(0, "10.0.0.1", "n0"), NodeSlot(1, "10.0.0.2", "n1")], 2)[rank]
    return contract_env(
        slot,
        world_size=4,
        local_world_size=2,
        num_nodes=2,
        master_addr="10.0.0.1",
        master_port=29511,
        run_id="job",
        visible_devices="0,1",
    )


def test_contract_covers_torchrun_and_numbers_are_right():
    env = _contract(rank=3)
    assert TORCHRUN_KEYS <= set(env) == set(CONTRACT_KEYS)
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["NODE_RANK"]) == ("3", "1", "1", "1")
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("4", "2", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29511")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the string torch compares with


def test_env_precedence_and_every_change_of_a_node_value_is_logged():
    d = decide_env(
        _contract(),
        node_env={"OMP_NUM_THREADS": "8", "NCCL_DEBUG": "INFO", "FOO": "node", "RANK": "7"},
        profile={"NCCL_DEBUG": "WARN", "FI_PROVIDER": "efa", "BAR": "profile"},
        profile_name="efa",
        overrides={"FOO": "cli", "BAR": "cli"},
    )
    s = d.to_set
    assert s["RANK"] == "1"  # contract wins
    assert "OMP_NUM_THREADS" not in s  # the node's own value is kept, not replaced by our default
    assert s["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # default where the node had none
    assert (s["NCCL_DEBUG"], s["FI_PROVIDER"]) == ("WARN", "efa")  # profile over node
    assert (s["FOO"], s["BAR"]) == ("cli", "cli")  # --env over node and profile
    notes = "\n".join(d.notes)
    for expected in (
        "RANK: node had '7'",
        "OMP_NUM_THREADS: keeping the node's '8'",
        "NCCL_DEBUG: profile efa sets 'WARN' over the node's 'INFO'",
        "FOO: --env sets its value over the node's 'node'",
        "BAR: --env sets its value over profile efa's",
    ):
        assert expected in notes
    assert "'cli'" not in notes  # --env values never reach the console


def test_env_defaults_apply_when_the_node_has_nothing():
    d = decide_env(_contract(), node_env={}, profile={}, profile_name=None, overrides={})
    assert d.to_set["OMP_NUM_THREADS"] == "1" and d.notes == ()


def test_env_pairs_are_checked():
    assert parse_env_pairs(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    with pytest.raises(ValueError, match="--env A forwards this shell's A, which is not set"):
        parse_env_pairs(["A"], {})
    assert parse_env_pairs(["A"], {"A": "from the shell"}) == {"A": "from the shell"}  # as docker run -e A
    with pytest.raises(ValueError, match="sets MASTER_PORT, RANK, which the launcher sets"):
        parse_env_pairs(["RANK=0", "MASTER_PORT=1"])
    with pytest.raises(ValueError, match="not a valid environment variable name"):
        parse_env_pairs(["1A=0"])


# -- profiles -----------------------------------------------------------------------------------
def test_efa_profile_holds_the_aws_values():
    env = load_profile("efa")
    assert env == {
        "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1", "NCCL_DEBUG": "WARN",
        "NCCL_BUFFSIZE": "8388608", "NCCL_P2P_NET_CHUNKSIZE": "524288", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "OMP_NUM_THREADS": "1"}  # fmt: skip
    assert {"efa", "infiniband", "tcp", "cpu"} <= set(available_profiles())


def test_bad_profiles_say_what_to_do(tmp_path):
    with pytest.raises(UsageError, match="unknown env profile 'nope'; choose one of cpu, efa"):
        load_profile("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("env:\n  WORLD_SIZE: 3\n")
    with pytest.raises(UsageError, match="sets WORLD_SIZE, which the launcher sets"):
        load_profile(str(bad))
    empty = tmp_path / "empty.yaml"
    empty.write_text("description: nothing\n")
    with pytest.raises(UsageError, match="no `env:` mapping"):
        load_profile(str(empty))


# -- the spec -------------------------------------------------------------------------------------
def test_spec_from_args_reads_the_torchrun_shape(tmp_path):
    spec = spec_from_args(
        ["--nodes", "2", "--gpus-per-node", "8", "train.py", "--lr", "3e-4"],
        environ={"RAY_ADDRESS": "127.0.0.1:6379"},
        cwd=str(tmp_path),
    )
    assert (spec.nodes, spec.gpus_per_node, spec.world_size) == (2, 8, 16)
    assert spec.target == Target("script", "train.py", ("--lr", "3e-4"))
    assert spec.address == "127.0.0.1:6379" and spec.job_name.startswith("megaray-")
    ep = spec_from_args(["--entrypoint", "pkg.mod:fn", "x", "--y"], environ={})
    assert ep.target == Target("entrypoint", "pkg.mod:fn", ("x", "--y")) and ep.address is None
    with pytest.raises(AttributeError):
        spec.nodes = 3  # frozen
    assert spec.spares and not spec_from_args(["--no-spares", "--dry-run"], environ={}).spares


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0", "--dry-run"], "--nodes must be at least 1, got 0"),
        (["--gpus-per-node", "-2", "--dry-run"], "--gpus-per-node must be at least 1, got -2"),
        (["--placement-timeout", "0", "--dry-run"], "--placement-timeout must be above 0 seconds, got 0.0"),
        (["--master-port", "70000", "--dry-run"], "--master-port must be within 1-65535, got 70000"),
        (["--job-name", "a b", "--dry-run"], "--job-name 'a b' must be"),
        (["--entrypoint", "m:f", "--dry-run"], "--dry-run runs the built-in check"),
        (["--entrypoint", "nocolon"], "is not of the form pkg.module:function"),
        ([], "nothing to run"),
        (["--device", "tpu", "--dry-run"], "invalid choice: 'tpu'"),
        (["--device", "cpu", "--cpus-per-rank", "0", "--dry-run"], "--cpus-per-rank must be above 0"),
        (["--kill-grace", "nan", "--dry-run"], "argument --kill-grace: must be a finite number, got 'nan'"),
        (["--placement-timeout", "inf", "--dry-run"], "--placement-timeout: must be a finite number"),
        (["--hang-timeout", "1e400", "--dry-run"], "--hang-timeout: must be a finite number"),
        (["up", "--cpus-per-rank", "-1"], "--cpus-per-rank must be above 0 with --device cpu, got -1.0"),
        (["up", "--idle-timeout", "nan"], "argument --idle-timeout: must be a finite number, got 'nan'"),
        (["up", "--nodes", "0"], "--nodes must be at least 1, got 0"),
        (["up", "--gpus-per-node", "100000"], "100000 CPU ranks would be 100000 processes on this machine"),
        (["--device", "cpu", "--gpus-per-node", "100000", "--dry-run"], "which holds at most"),
        (
            ["--gpus-per-node", "4", "--log-ranks", "1-0", "--dry-run"],
            "the range 1-0 runs backwards (write 0-1)",
        ),
        (["--gpus-per-node", "4", "--log-ranks", "3-1,x", "--dry-run"], "(write 1-3); 'x' is not a rank"),
        (["--recipe", "./nope.yaml"], "recipe file ./nope.yaml not found"),
        (["--address", "http://127.0.0.1:8265", "--dry-run"], "is a dashboard's URL, which `megaray submit`"),
        (["--address", "http://[::1", "--dry-run"], "is a dashboard's URL"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_spec_validates_itself():
    with pytest.raises(ValueError, match="--nodes must be at least 1, got -1"):
        LaunchSpec(nodes=-1, gpus_per_node=1, target=Target("script", "x.py"), job_name="j")
    with pytest.raises(ValueError, match="--kill-grace must be a finite number, got nan"):
        LaunchSpec(
            nodes=1, gpus_per_node=1, target=Target("script", "x.py"), job_name="j", kill_grace_s=float("nan")
        )


def test_missing_targets_are_caught_in_the_driver(tmp_path):
    (tmp_path / "mod.py").write_text("def present():\n    pass\nalias = present\n")
    check_target_locally(Target("entrypoint", "mod:present"), str(tmp_path))
    check_target_locally(Target("entrypoint", "mod:alias"), str(tmp_path))
    with pytest.raises(UsageError, match="defines no absent"):
        check_target_locally(Target("entrypoint", "mod:absent"), str(tmp_path))
    with pytest.raises(UsageError, match="no module named nosuchmod"):
        check_target_locally(Target("entrypoint", "nosuchmod:f"), str(tmp_path))
    with pytest.raises(UsageError, match=r"script nope\.py not found"):
        check_target_locally(Target("script", "nope.py"), str(tmp_path))
    dry = Target(DRY_RUN_TARGET.kind, DRY_RUN_TARGET.name, ("data=d/corpus",))
    with pytest.raises(UsageError, match=r"--dry-run data=d/corpus: no d/corpus\.bin and \.idx"):
        check_target_locally(dry, str(tmp_path))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "corpus.bin").write_bytes(b"")
    (tmp_path / "d" / "corpus.idx").write_bytes(b"")
    check_target_locally(dry, str(tmp_path))  # relative to the launch's working directory, as ranks read it


def test_a_folder_as_script_or_as_state_dir_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    assert main(["--device", "cpu", "adir"]) == 2
    assert "script adir is a folder, not a Python file" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("MEGARAY_STATE_DIR", str(tmp_path / "afile"))
    for argv in (["list"], ["down"], ["up"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert (
            f"MEGARAY_STATE_DIR names {tmp_path / 'afile'}, which is not a folder" in err
            and err.count("\n") == 1
        )


def test_missing_script_exits_2_before_any_ray(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--nodes", "1", "missing.py"]) == 2
    assert "script missing.py not found" in capsys.readouterr().err


# -- failure reports ------------------------------------------------------------------------------
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


def test_a_node_lost_while_its_ranks_start_fails_those_ranks_as_died_naming_the_node():
    from launcher.core.topology import RankSlot
    from launcher.driver.endings import lost_while_starting, silent

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
    from launcher.driver.cluster import check_versions

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


# -- Megatron layouts -----------------------------------------------------------------------------
def test_layout_that_fits_has_no_problems():
    from launcher.core.layout import Layout, layout_problems

    deepseek = Layout(tp=8, pp=1, ep=2, global_batch=64, micro_batch=1, num_heads=16, num_query_groups=16,
                      num_experts=64)  # fmt: skip
    assert layout_problems(deepseek, nodes=2, gpus_per_node=8) == []


def test_the_dry_run_keeps_the_tp_or_pp_given_and_takes_megatrons_1_for_the_other():
    from launcher.megatron.tiny_gpt import resolve_layout

    assert resolve_layout(8, 4, None, None) == (2, 2)  # its own: TP inside a node, then PP
    assert resolve_layout(8, 4, 4, None) == (4, 1)  # was (2, 2): the TP given was dropped
    assert resolve_layout(8, 4, None, 4) == (1, 4)
    assert resolve_layout(8, 4, 1, 1) == (1, 1)


def test_layout_problems_print_the_numbers():
    from launcher.core.layout import Layout, layout_problems

    problems = layout_problems(
        Layout(tp=4, pp=3, ep=3, global_batch=10, micro_batch=4, num_heads=6, num_experts=64),
        nodes=2,
        gpus_per_node=2,
    )
    text = "\n".join(problems)
    assert "TP 4 x PP 3 x CP 1 = 12 does not divide world size 4 (--nodes 2 x --gpus-per-node 2)" in text
    assert "TP 4 must fit within one node of 2 GPUs" in text
    assert "expert TP 4 x EP 3 x PP 3 = 36 does not divide world size 4" in text
    assert "EP 3 does not divide the 64 experts" in text
    assert "global batch 10 is not a multiple of micro batch 4 x DP 1 = 4" in text
    assert "TP 4 does not divide the 6 attention heads" in text
    assert len(problems) == 6


def test_failures_pickle_and_print_like_the_cli():
    import pickle

    from launcher.core.errors import Interrupted

    err = RankFailedError(
        [RankFailure(2, "10.0.0.3", "h", "1", "exception", "KeyError: 'x'", "tb", at=1.0)], 4
    )
    again = pickle.loads(pickle.dumps(err))
    assert again.report() == err.report() and str(again) == str(err) and again.exit_code == 1
    stopped = pickle.loads(pickle.dumps(Interrupted(15, "SIGTERM")))
    assert stopped.exit_code == 143 and "SIGTERM" in str(stopped)


def test_the_package_exports_its_public_names_without_importing_ray():
    import subprocess
    import sys

    code = "import launcher, sys; assert 'ray' not in sys.modules; print(sorted(launcher.__all__))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    import launcher

    assert callable(launcher.launch) and launcher.LaunchResult.__name__ == "LaunchResult"


# -- warm spares ----------------------------------------------------------------------------------
def test_spares_import_the_launcher_stack_never_user_code():
    def warm_steps(target):
        return runner_for(target).warm_imports(target)

    assert warm_steps(Target("script", "train.py")) == ("torch", "torch.distributed")
    assert warm_steps(Target("entrypoint", "mypkg.train:main")) == ("torch", "torch.distributed")
    dry = warm_steps(DRY_RUN_TARGET)
    assert "megatron.core.models.gpt" in dry and "launcher.megatron.tiny_gpt" in dry
    recipe = load_recipe("llama3_8b")
    steps = warm_steps(Target("megatron", "llama3_8b", recipe=recipe))
    assert steps.index("launcher.megatron.compat:import_bridge") < steps.index(
        "megatron.bridge.training.pretrain"
    )
    assert recipe.function.partition(":")[0] in steps


def test_every_kind_of_target_has_a_runner_and_plain_programs_resume_themselves():
    from launcher.core.spec import spec_from_args
    from launcher.core.target import TargetKind
    from launcher.driver.targets import RUNNERS

    assert set(RUNNERS) == set(TargetKind)
    spec = spec_from_args(["train.py", "--lr", "1"])
    runner = runner_for(spec.target)
    assert runner.preflight(spec) is None and runner.first_target(spec, None) == spec.target
    assert runner.resume_target(spec.target, None) == spec.target  # TORCHELASTIC_RESTART_COUNT tells it
    assert runner.relays_output and not runner_for(Target("group", "rank group")).relays_output
    assert {f.rsplit("/", 2)[-2] + "/" + f.rsplit("/", 1)[-1] for f in runner.own_files()} == {
        "core/runner.py", "rank/programs.py",
    }  # fmt: skip


def test_warm_applies_the_env_first_and_reports_what_did_not_import(monkeypatch):
    monkeypatch.delenv("MEGARAY_TEST_WARM", raising=False)
    result = warm(
        {"MEGARAY_TEST_WARM": "1"},
        ("json", "megaray_no_such_module", "launcher.megatron.compat:te_installed"),
    )
    assert os.environ.pop("MEGARAY_TEST_WARM") == "1"
    assert list(result["failed"]) == ["megaray_no_such_module"]
    assert "ModuleNotFoundError" in result["failed"]["megaray_no_such_module"]
    assert result["cuda_initialized"] is False
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ  # only for the imports


def test_a_spare_waits_for_the_process_it_replaces():
    assert wait_gone(2**22 + 12345, timeout_s=0.1)  # no such pid: gone
    assert not wait_gone(os.getpid(), timeout_s=0.1)  # still here when the wait ends


def test_installed_answers_for_dotted_names_whose_parent_is_missing():
    # find_spec("megatron.core") raises where megatron is absent: the README demo's first failure.
    from launcher.megatron.compat import installed

    assert installed("json.decoder")
    assert not installed("no_such_top_level_pkg.core")
    assert not installed("json.no_such_submodule")


def test_each_rank_names_the_interface_of_its_nodes_ray_ip_unless_told_otherwise():
    from launcher.core.rankenv import decide_envs
    from launcher.core.topology import RankSlot

    slots = [RankSlot(r, 0, r, r, 0, f"10.0.0.{r + 1}", f"n{r}") for r in range(3)]
    common = dict(world_size=3, local_world_size=1, num_nodes=3, master_addr="10.0.0.1", master_port=29500,
                  run_id="j", restart_count=0, max_restarts=0, profile_name="tcp", overrides={})  # fmt: skip
    node_envs = [{}, {"GLOO_SOCKET_IFNAME": "bond0"}, {}]
    d = decide_envs(slots, [(), (), ()], node_envs, profile={}, ifaces=["eth0", "ens5", None], **common)
    assert (d[0].to_set["GLOO_SOCKET_IFNAME"], d[0].to_set["NCCL_SOCKET_IFNAME"]) == ("eth0", "=eth0")
    assert "GLOO_SOCKET_IFNAME" not in d[1].to_set  # the node's own setting is kept, and said
    assert any("GLOO_SOCKET_IFNAME: keeping the node's 'bond0'" in n for n in d[1].notes)
    assert "GLOO_SOCKET_IFNAME" not in d[2].to_set  # interface unknown: nothing guessed
    profile = {"NCCL_SOCKET_IFNAME": "^docker,lo,veth"}  # env/tcp.yaml
    d = decide_envs(slots, [(), (), ()], [{}, {}, {}], profile=profile, ifaces=["eth0"] * 3, **common)
    assert (
        d[0].to_set["NCCL_SOCKET_IFNAME"] == "^docker,lo,veth" and d[0].to_set["GLOO_SOCKET_IFNAME"] == "eth0"
    )


BRIDGE_LIKE_MODULE = """
from megatron.bridge import AutoBridge

HF = "acme/Tiny-7B"

def _common(hf_path):
    cfg = make()
    cfg.model = AutoBridge.from_hf_pretrained(hf_path).to_megatron_provider()
    return cfg

def tiny_7b_pretrain_8gpu_h100_bf16_config():
    cfg = _common(HF)
    cfg.model.tensor_model_parallel_size = 2
    cfg.model.context_parallel_size = 2
    return cfg

def tiny_7b_peft_1gpu_h100_bf16_config(peft_scheme="lora"):
    cfg = tiny_7b_pretrain_8gpu_h100_bf16_config()
    cfg.model.tensor_model_parallel_size = 1
    return cfg

def _private_config():
    pass

def helper():
    pass
"""


def test_bridge_recipes_are_read_from_source_without_importing_it(tmp_path):
    from launcher.core.catalog import scan

    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "h100.py").write_text(BRIDGE_LIKE_MODULE)
    (tmp_path / "tiny" / "__init__.py").write_text("from .h100 import *\n")
    found = {r.name: r for r in scan(tmp_path)}
    assert sorted(found) == ["tiny_7b_peft_1gpu_h100_bf16_config", "tiny_7b_pretrain_8gpu_h100_bf16_config"]
    pre, peft = found["tiny_7b_pretrain_8gpu_h100_bf16_config"], found["tiny_7b_peft_1gpu_h100_bf16_config"]
    assert (pre.family, pre.kind, pre.gpus, pre.hardware, pre.layout) == (
        "tiny",
        "pretrain",
        8,
        "h100",
        "TP2 CP2",
    )
    assert pre.ref == "megatron.bridge.recipes.tiny.h100:tiny_7b_pretrain_8gpu_h100_bf16_config"
    assert pre.hf_model == peft.hf_model == "acme/Tiny-7B"  # through a helper, and through another recipe
    assert (peft.kind, peft.gpus, peft.layout) == ("peft", 1, "TP1")


def test_memory_terms_bridge_leaves_out_by_hand():
    from launcher.core.memory import (
        GIB,
        MemoryEstimate,
        attention_scores_bytes,
        fit_problem,
        frozen_model_state,
        full_recompute_saving,
    )

    # 16 heads, seq 2048, micro 4, 16 layers: 5 x 16 x 2048^2 x 4 bytes per layer = 1.25 GiB
    assert attention_scores_bytes(2048, 4, 16, 16, 1, 1, 1, 2) == 5 * 16 * 2048**2 * 4 * 16
    assert attention_scores_bytes(2048, 4, 16, 16, 2, 2, 1, 2) == 5 * 16 * 2048**2 * 4 * 16 / 4  # TP x CP
    assert attention_scores_bytes(2048, 4, 16, 16, 1, 1, 4, 2) == 5 * 16 * 2048**2 * 4 * 16 / 2  # 2 of PP 4
    # full recompute: 15 of 16 layers keep 2sbh instead of sbh(18 + 4 x 4)
    sbh = 2048 * 4 * 2048
    assert full_recompute_saving(2048, 4, 2048, 16, 4.0, 1, 1) == 15 * 34 * sbh - 16 * 2 * sbh
    assert frozen_model_state(8e9) == 16e9  # bf16 weights only
    est = MemoryEstimate(model_state=60 * GIB, activations=25 * GIB, parameters=8.03e9)
    assert est.describe().startswith(
        "85.0 GiB per GPU at the first step (weights, gradients and optimizer 60.0"
    )
    assert fit_problem(est, 80) == f"needs {est.describe()}, more than the 80 GiB of one GPU"
    assert fit_problem(est, 96) is None


def test_data_paths_a_config_names_are_checked(tmp_path):
    from launcher.core.dataset_paths import blend_prefixes, missing_data

    assert blend_prefixes((["/d/a", "/d/b"], [0.3, 0.7])) == ["/d/a", "/d/b"]
    assert blend_prefixes(["0.3", "/d/a", "0.7", "/d/b"]) == ["/d/a", "/d/b"]
    assert blend_prefixes([["./d/a"], None]) == ["./d/a"]  # the pair, as a YAML override gives it
    assert blend_prefixes(None) == []
    (tmp_path / "a.bin").write_bytes(b"")
    (tmp_path / "a.idx").write_bytes(b"")
    (tmp_path / "b.bin").write_bytes(b"")
    missing = missing_data(
        [str(tmp_path / "a"), str(tmp_path / "b")],
        str(tmp_path / "sft"),
        [
            ("tokenizer.tokenizer_model", "meta-llama/Meta-Llama-3-8B"),
            ("tokenizer.vocab_file", "/no/vocab.json"),
        ],
    )
    assert missing == [
        f"dataset.blend prefix {tmp_path}/b has no {tmp_path}/b.idx",
        f"dataset.dataset_root {tmp_path}/sft is not a folder",
        "tokenizer.vocab_file /no/vocab.json does not exist",
    ]


def test_the_doctor_s_link_matrix_names_each_pair_that_cannot_connect():
    from launcher.cli.doctor import link_matrix

    ips, ifaces = ["10.0.0.9", "10.0.0.10"], ["ens5", None]
    table, failed = link_matrix(ips, ifaces, [[None, None], ["no answer within 3 s", None]])
    assert table.splitlines()[1].split() == ["0", "10.0.0.9", "ens5", "-", "ok"]
    assert table.splitlines()[2].split() == ["1", "10.0.0.10", "?", "FAIL", "-"]
    assert failed == [
        "node 1 (10.0.0.10, ?) cannot reach node 0 (10.0.0.9, ens5) on the rendezvous ports: no answer "
        "within 3 s"
    ]


def test_the_network_s_ca_and_proxies_reach_ranks_and_start_up_variables_are_told_apart():
    from launcher.core.rankenv import forwarded_env, startup_env

    shell = {"SSL_CERT_FILE": "/etc/ca.pem", "https_proxy": "http://p:3128", "MY_PASSWORD": "x", "HOME": "/h"}
    assert forwarded_env(shell) == {"SSL_CERT_FILE": "/etc/ca.pem", "https_proxy": "http://p:3128"}
    got = startup_env(
        profile={"LD_LIBRARY_PATH": "/opt/efa/lib", "NCCL_DEBUG": "WARN", "PYTHONHASHSEED": "1"},
        forwarded={"MALLOC_ARENA_MAX": "2"},
        overrides={"PYTHONHASHSEED": "0", "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    )
    assert got == {
        "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0",
        "LD_LIBRARY_PATH": "/opt/efa/lib",
        "MALLOC_ARENA_MAX": "2",
        "PYTHONHASHSEED": "0",  # --env over the profile
    }


def test_help_names_every_command_with_one_line_each(capsys):
    from launcher.cli.commands import COMMANDS
    from launcher.cli.main import main as cli_main

    with pytest.raises(SystemExit) as done:
        cli_main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    listed = out[out.index("commands (megaray COMMAND --help for each):") :].splitlines()[1:]
    names = [ln.split()[0] for ln in listed if ln.startswith("  ") and ln.strip()]
    assert names == ["up", "down", "list", "submit", "status", "logs", "stop", "recipes", "doctor"]
    assert set(names) == set(COMMANDS)
    for name in names:  # each command answers --help itself
        with pytest.raises(SystemExit) as sub:
            cli_main([name, "--help"])
        assert sub.value.code == 0, name


def test_a_crash_in_ray_s_own_teardown_is_told_from_the_program_s():
    from launcher.core.deaths import ray_teardown_crash

    ray_s = [
        "[mutex.cc : 452] RAW: Lock blocking 0x5604d1504610   @ 0x7f9d28c51712 0x7f9d27d0176c",
        "[mutex.cc : 1957] RAW: Check (v & (kMuWait | kMuWrWait)) != kMuWrWait failed: Lock: Mutex corrupt",
        "Fatal Python error: Aborted",
    ]
    program_s = ["rank 1 returning", "Fatal Python error: Aborted", "", "Stack (most recent call first):"]
    assert ray_teardown_crash(ray_s) and not ray_teardown_crash(program_s)


def test_a_blas_takes_the_threads_it_reads_at_load():
    from launcher.core.blas import blas_threads

    assert blas_threads("openblas", {"OMP_NUM_THREADS": "2"}, cpus=96) == 2
    assert blas_threads("openblas", {"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "3"}, cpus=96) == 3
    assert blas_threads("mkl", {"OPENBLAS_NUM_THREADS": "3", "OMP_NUM_THREADS": "4,2"}, cpus=96) == 4
    assert blas_threads("openblas", {"OMP_NUM_THREADS": "0"}, cpus=96) == 96  # unset or 0: every CPU
    assert blas_threads("flexiblas", {"OMP_NUM_THREADS": "2"}, cpus=96) is None  # not known: left alone


def test_groups_sharing_a_node_are_all_found_in_one_pass():
    from launcher.driver.placement import sort_out

    assert sort_out(set(), [(0, "a"), (1, "b"), (2, "c")]) == ([0, 1, 2], [])
    # placed again together, in one round: on a node held before, or by an earlier one of these
    assert sort_out({"z"}, [(0, "a"), (1, "a"), (2, "b"), (3, "z"), (4, "b")]) == ([0, 2], [1, 3, 4])


def test_the_doctor_checks_every_link_of_a_small_cluster_and_a_few_per_node_of_a_large_one():
    from launcher.cli.doctor import MATRIX_NODES, link_targets

    small = link_targets(4, every_pair=False)
    assert small == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]
    large = link_targets(1024, every_pair=False)
    assert sum(map(len, large)) == 3 * 1024  # not 1024 x 1023
    assert large[0] == [1, 2, 512] and large[1023] == [0, 1, 511]
    halves = {(i, j) for i, row in enumerate(large) for j in row if (i < 512) != (j < 512)}
    assert halves  # a split of the nodes into two halves is crossed
    assert len(link_targets(MATRIX_NODES + 1, every_pair=True)[0]) == MATRIX_NODES
