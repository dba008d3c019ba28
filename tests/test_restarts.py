"""Surviving failures on a simulated cluster: a killed rank, a lost node, a hung rank, and running
out of restarts. Drivers run as separate processes, as users run them, so the test can kill ranks
and remove nodes while they run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.util.state import list_actors

from launcher.driver.cluster.cluster import SIMULATED_NODE, stop_simulated
from launcher.driver.supervision.supervise import STARTUP_GRACE_S

from . import drive
from .conftest import REPO, connected, documented_fields, leftovers, simulated_cluster

sys.path.insert(0, str(REPO / "bench"))
from common import throttle

# Ray declares a node dead after health_check_failure_threshold missed checks, one every
# health_check_period_ms (defaults: 5 x 3 s): faster here, as docs/guides/failures.md shows how to set it.
HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
NODE = {"num_cpus": 2, "num_gpus": 2, **SIMULATED_NODE}

LOOP = """
import os, time
import torch, torch.distributed as dist
from launcher import report
dist.init_process_group("gloo")
rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
steps = 3 if restart else 400
for i in range(steps):
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 0:
        print(f"restart {restart} step {i}", flush=True)
        report(i + 1)  # progress: the warm spares start now rather than after 30 s
    time.sleep(0.1)
dist.destroy_process_group()
"""

FAIL_ALWAYS = "import os\nif os.environ['RANK'] == '1':\n    raise SystemExit('rank one cannot go on')\n"

STOPPER = """
import os, signal
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} joined", flush=True)
dist.barrier()
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
dist.barrier()
"""


@pytest.fixture(scope="module")
def cluster():
    os.chdir(REPO)
    c = simulated_cluster({"_system_config": HEALTH}, [NODE, NODE])
    ray.init(address=c.address, namespace="megaray")
    yield c
    ray.shutdown()
    stop_simulated(c)  # as megaray stops its own: a second of Ray's stop saved


def driver(cluster, job: str, runs: Path, args: str, log: Path | None = None) -> subprocess.Popen:
    return drive.start(
        "--job-name", job, "--address", cluster.address, "--runs-dir", str(runs), *args.split(), log=log
    )


def wait_for_line(path: Path, pattern: str, proc: subprocess.Popen, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            found = re.search(pattern, path.read_text())
            if found:
                return found.group(0)
        assert proc.poll() is None, (proc.communicate()[0] or "")[-4000:]
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} never appeared in {path}")


def test_a_killed_rank_is_relaunched_and_training_resumes_from_the_last_checkpoint(cluster, tmp_path):
    runs, ckpt = tmp_path / "runs", tmp_path / "ckpt"
    job = "resume"
    # a rank per node: the two nodes, their spares and the relaunch, at half the processes of 2 x 2
    args = f"--nodes 2 --gpus-per-node 1 --max-restarts 1 --dry-run steps=40 save={ckpt} save_every=5"
    log = tmp_path / "driver.log"
    where = ("--job-name", job, "--address", cluster.address, "--runs-dir", str(runs))
    proc = drive.start(*where, *args.split(), log=log)
    # the relaunch is to take the spares: on a loaded machine the kill came before they were started
    wait_for_line(log, r"starting 2 warm spare\(s\)", proc)
    wait_for_line(runs / job / "rank-0.log", r"saved checkpoint at iteration 10\b", proc)
    victim = json.loads((runs / job / "topology.json").read_text())["ranks"][1]["pid"]
    os.kill(victim, 9)
    proc.wait(timeout=240)
    out = log.read_text()
    assert proc.returncode == 0, out[-5000:]
    assert "restart 1 of 1 after: rank 1 on" in out and "SIGKILL" in out
    assert "a signal sent from outside the job" in out
    # the relaunch ran on the spares started beside the first attempt, in its placement groups
    assert "relaunching every rank (on the warm spares)" in out
    log = (runs / job / "rank-0.log").read_text()
    before, after = log.split("resumed from checkpoint at iteration ")
    resumed = int(after.split()[0])
    saved_before = [int(n) for n in re.findall(r"saved checkpoint at iteration (\d+)", before)]
    assert resumed == max(saved_before) >= 10  # nothing older than the last checkpoint
    summary = json.loads((runs / job / "summary.json").read_text())
    assert summary["status"] == "succeeded" and len(summary["restarts"]) == 1
    assert set(summary) <= documented_fields("summary.json"), summary.keys()
    assert summary["restarts"][0]["warm_spares"] is True
    assert summary["progress"]["iteration"] == 40  # the iteration count carried on to the end
    assert summary["started_at"] < summary["progress"]["first_report_at"] < summary["ended_at"]
    trained = re.search(r"loss [\d.]+ -> [\d.]+ over (\d+) steps", out)
    assert trained and int(trained.group(1)) == 40 - resumed
    # where the time went (#47): the parts add up to the run's time, the relaunch and the training in it
    goodput = summary["goodput"]
    parts = goodput["seconds"]
    assert sum(parts.values()) == pytest.approx(summary["duration_s"], rel=0.02), goodput
    assert parts["training"] > 0 and parts["start-up"] > 0 and parts["restarts"] > 0, goodput
    assert "not_seen" not in goodput, goodput  # the dry run says its saves and load (a few ms each here)
    assert goodput["ratio"] == pytest.approx(parts["training"] / goodput["wall_s"], abs=1e-3)
    assert re.search(r"megaray: goodput [\d.]+% of \S+: training \S+, start-up \S+, restarts \S+ \(1\)", out)
    assert leftovers(job) == ([], [])


# An unchanged gloo program: every step each rank computes (a sleep here), then an all-reduce. For
# `balanced` seconds every rank takes 0.01-0.09 s at random, so that each waits for whoever was last, a
# good share of the time; then rank 3 computes 0.2 s a step where the others take 0.05 s (the moment,
# agreed by all, is written to `stop`.switch). It stops after `seconds`, or once the file `stop`
# exists, all ranks at once.
STRAGGLER = """
import os, random, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, balanced, seconds, stop = dist.get_rank(), float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
switch = torch.tensor([time.time() + balanced], dtype=torch.float64)
dist.all_reduce(switch, op=dist.ReduceOp.MAX)
switch = switch.item()
if rank == 3:
    with open(stop + ".switch", "w") as f:
        f.write(repr(switch))
end = switch + seconds
while True:
    if time.time() < switch:
        time.sleep(random.uniform(0.01, 0.09))
    else:
        time.sleep(0.2 if rank == 3 else 0.05)
    done = torch.tensor([1.0 if time.time() > end or os.path.exists(stop) else 0.0])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    if done.item():
        break
dist.destroy_process_group()
"""


@pytest.mark.alone  # it times ranks against each other
def test_the_rank_the_others_wait_for_is_named_and_nobody_while_balanced(cluster, tmp_path):
    """One run, balanced for 12 s (every rank waits for whoever was last), then rank 3 slow: nobody is
    named in the first part; rank 3, with its node, in the second (formerly two runs)."""
    job = "slow"
    script = tmp_path / "straggler.py"
    script.write_text(STRAGGLER)
    # Named about 10 s after the switch here; the run ends once it is (CI's loaded machine once took
    # longer than a fixed 18 s), at most 90 s after the switch.
    stop = tmp_path / "stop"
    proc = driver(cluster, job, tmp_path, f"--device cpu --nodes 2 --gpus-per-node 2 {script} 12 90 {stop}")
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if " is slow: " in line:
            stop.touch()
    proc.wait(timeout=240)
    out = "".join(lines)
    assert proc.returncode == 0, out[-4000:]
    named = re.findall(r"megaray: rank (\d+) on (\S+) \(\S+\) is slow: about ([\d.]+)x", out)
    topology = json.loads((tmp_path / job / "topology.json").read_text())
    assert [(r, ip) for r, ip, _ in named] == [("3", topology["ranks"][3]["node_ip"])], out[-3000:]
    assert 2.0 <= float(named[0][2]) <= 6.0  # 4x as long a step as its peers, measured roughly
    (record,) = json.loads((tmp_path / job / "stragglers.json").read_text())
    assert record["rank"] == 3 and record["peers_waiting"] > 0.5 and record["waiting"] < 0.2
    assert record["since"] >= float((tmp_path / "stop.switch").read_text())  # not while balanced


@pytest.mark.alone  # it times ranks against each other
def test_a_slow_rank_is_named_and_its_node_dropped_at_the_next_checkpoint_and_kept_off(cluster, tmp_path):
    """The dry-run trainer (Megatron's schedule, TP 1 x PP 1 x DP 3, one CPU rank on each of 3 nodes)
    with its forward steps timed by megaray, `--nodes 2:3 --evict-stragglers 5`: balanced for its
    first 12 s of training, nobody is named; then rank 2, made 8x slower, is named with its node and
    both step times, and 5 s later, at the next checkpoint, its node is dropped: the job relaunches on
    the 2 others (not counted against --max-restarts, which is 0), resumes from that checkpoint (no
    step after it lost), never places on the slow node again, and ends with exit 0. The ledger puts
    the slow stretch under straggler and the relaunch under restarts. (Formerly two runs: a slow rank
    named on one node, then dropped.) The trainer takes SIGTERM as Megatron-Bridge's
    `exit_signal_handler` does (a checkpoint at the next step, then exit 0): megaray's stop of the
    first attempt lets it save, and once resumed the test sends the relaunched ranks SIGTERM, so that
    the run ends at any pace, not after the ~250 steps a slow machine had left (~25 s of 2 ranks)."""
    runs, ckpt, job = tmp_path / "runs", tmp_path / "ckpt", "evict"
    args = (
        "--nodes 2:3 --gpus-per-node 1 --device cpu --cpus-per-rank 0.5 --no-spares --evict-stragglers 5 "
        f"--dry-run steps=450 save={ckpt} save_every=10 global_batch=24 exit_signal_handler=true"
    )
    proc = driver(cluster, job, runs, args)
    topology = runs / job / "topology.json"
    wait_for_line(topology, r'"pid"', proc, timeout_s=120)
    ranks = json.loads(topology.read_text())["ranks"]
    named, training, ended = threading.Event(), threading.Event(), threading.Event()
    slowed: list[float] = []

    def slow_after_balance() -> None:
        # balanced for 12 s from the first iteration (the straggler watch's window and confirmation
        # fit in it), not up to an iteration: a fast machine made 220 in 23 s and its console's
        # progress line came past 120 at 181, too late to be named
        if training.wait(120) and not named.wait(12.0):
            slowed.append(time.time())
            # an eighth of a core until its process ends with its node's drop: a quarter measured
            # 1.8x its peers with a busy loop beside the test (the peers share the rest with it)
            throttle(ranks[2]["pid"], ended, busy_s=0.0075, stopped_s=0.0525)

    throttler = threading.Thread(target=slow_after_balance, daemon=True)
    throttler.start()
    lines: list[str] = []
    sent_sigterm = False  # to the relaunched ranks, once
    try:
        for line in proc.stdout:
            lines.append(line)
            if "progress: iteration " in line:
                training.set()  # the first is shown as it comes
            if " is slow: " in line:
                named.set()
            if "resumed from checkpoint at iteration " in line and not sent_sigterm:  # the relaunched rank 0
                sent_sigterm = True  # once: a second SIGTERM after the training ended would kill a rank
                for rank in json.loads(topology.read_text())["ranks"]:
                    os.kill(rank["pid"], signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        training.set()
        named.set()
        ended.set()
        throttler.join()
    out = "".join(lines)
    assert proc.returncode == 0, out[-4000:]
    assert slowed, out[-3000:]
    slow_line = r"megaray: rank (\d+) on (\S+) \(\S+\) is slow: about ([\d.]+)x its peers' time per forward"
    assert [(r, ip) for r, ip, _ in re.findall(slow_line, out)] == [("2", ranks[2]["node_ip"])], out[-3000:]
    (record,) = json.loads((runs / job / "stragglers.json").read_text())
    assert record["rank"] == 2 and record["stage"] == 0, record
    assert record["step_s"] > 2 * record["peers_step_s"], record  # 8x, measured roughly
    assert record["since"] >= slowed[0]  # nobody while balanced
    dropped = r"a rank on node \S+ \(\S+\) has been slow for \d+s and a checkpoint was saved since: dropping"
    assert re.search(dropped + r" its node; relaunching every rank without it", out), out[-4000:]
    summary = json.loads((runs / job / "summary.json").read_text())
    assert [r["kind"] for r in summary["restarts"]] == ["evict"] and summary["status"] == "succeeded"
    log = (runs / job / "rank-0.log").read_text()
    before, after = log.split("resumed from checkpoint at iteration ")
    saved = [int(n) for n in re.findall(r"saved checkpoint at iteration (\d+)", before)]
    # the last one saved: the checkpoint that triggered the drop, or the one the trainer saved on the
    # SIGTERM that megaray's stop of the first attempt sent (--kill-grace 5 s), no step lost either way
    assert int(after.split()[0]) == max(saved), after[:200]
    stopped = re.search(r"exiting program after receiving SIGTERM at iteration (\d+)\.", after)
    assert stopped and f"saved checkpoint at iteration {stopped.group(1)} " in after, after[-2000:]
    relaunched = json.loads(topology.read_text())
    assert relaunched["nodes"]["running"] == 2, relaunched
    assert set(relaunched) == documented_fields("topology.json"), relaunched.keys()
    assert set(summary) <= documented_fields("summary.json"), summary.keys()
    first, then = _node_ids(ranks), _node_ids(relaunched["ranks"])
    assert len(set(first)) == 3 and first[2] not in then and len(set(then)) == 2, (first, then)
    spent = summary["goodput"]["seconds"]  # what it cost (#47): a share of the training while slow
    assert 0 < spent["straggler"] < spent["training"] and spent["restarts"] > 0, spent
    assert leftovers(job) == ([], [])


def run_script(cluster, tmp_path: Path, job: str, text: str, args: str) -> tuple[int, str]:
    """Run `text` as the script of a 2-node CPU launch with `args`; (exit code, output)."""
    script = tmp_path / f"{job}.py"
    script.write_text(text)
    proc = driver(cluster, job, tmp_path, f"--device cpu --nodes 2 --gpus-per-node 1 {args} {script}")
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


def test_restarts_exhausted_fail_with_the_last_cause(cluster, tmp_path):
    code, out = run_script(cluster, tmp_path, "exhaust", FAIL_ALWAYS, "--max-restarts 2")
    assert code == 1, out[-4000:]
    assert "restart 1 of 2 after: rank 1" in out and "restart 2 of 2 after: rank 1" in out
    assert "restart 3" not in out
    assert (
        out.rstrip().splitlines()[-1].startswith("=" * 10)
        and "rank one cannot go on" in out.split("restart 2")[1]
    )
    summary = json.loads((tmp_path / "exhaust" / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"], len(summary["restarts"])) == ("failed", 1, 2)
    assert "rank one cannot go on" in summary["root_cause"]
    assert "failures" in summary and set(summary) <= documented_fields("summary.json"), summary.keys()
    assert leftovers("exhaust") == ([], [])


def test_a_stopped_rank_is_reported_as_a_hang_with_stacks(cluster, tmp_path):
    code, out = run_script(cluster, tmp_path, "hang", STOPPER, "--hang-timeout 10")
    assert code == 1, out[-4000:]
    root = out.split("Root cause (first failure):")[1]
    assert "rank      : 1 of 2" in root and "process stopped (SIGSTOP)" in root
    assert "no output or progress from any rank for" in root
    others = root.split("Other failures:")[1]
    assert "rank 0 on" in others and "barrier" in others  # the waiting peer's stack, read by py-spy
    assert "stack of rank 0" in out
    # found by the 10 s --hang-timeout once the ranks had printed, not the start-up grace (120 s); how
    # long reading the stacks takes on a busy machine is bench/failures.py's to measure
    idle = int(re.search(r"no output or progress from any rank for (\d+)s", root).group(1))
    assert 10 <= idle < STARTUP_GRACE_S, idle
    summary = json.loads((tmp_path / "hang" / "summary.json").read_text())
    assert summary["status"] == "failed" and "SIGSTOP" in summary["root_cause"]
    assert leftovers("hang") == ([], [])


def _node_ids(ranks: list[dict]) -> list[str]:
    """The node of each rank of topology.json, from its process (Ray keeps ended actors listed)."""
    pids = [r["pid"] for r in ranks]
    return [
        next(a.node_id for a in list_actors(address=connected(), filters=[("pid", "=", p)])) for p in pids
    ]


def _node_of_rank(cluster, runs: Path, job: str, rank: int):
    ip_pid = json.loads((runs / job / "topology.json").read_text())["ranks"][rank]["pid"]
    node_id = next(a.node_id for a in list_actors(address=connected(), filters=[("pid", "=", ip_pid)]))
    return next(n for n in cluster.worker_nodes if n.node_id == node_id)


def test_a_lost_node_is_detected_and_the_job_relaunched_when_a_node_returns(cluster, tmp_path):
    proc = driver(
        cluster, "nodeloss", tmp_path, f"--nodes 2 --gpus-per-node 1 --max-restarts 1 {_loop(tmp_path)}"
    )
    wait_for_line(tmp_path / "nodeloss" / "rank-0.log", r"restart 0 step 5\b", proc)
    wait_for_spares("nodeloss", 2, proc)
    cluster.remove_node(_node_of_rank(cluster, tmp_path, "nodeloss", 1))
    time.sleep(2)
    cluster.add_node(**NODE)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-5000:]
    assert "restart 1 of 1 after: rank" in out
    # a spare was lost with the node: every rank is placed anew, on the node that came back (the spares
    # are not even asked: the node is known lost)
    assert "on a lost node: placing every rank anew" in out
    assert "restart 1 step 2" in (tmp_path / "nodeloss" / "rank-0.log").read_text()
    assert leftovers("nodeloss") == ([], [])


def test_a_lost_node_that_never_returns_fails_clearly(cluster, tmp_path):
    args = f"--nodes 2 --gpus-per-node 1 --max-restarts 1 --placement-timeout 5 {_loop(tmp_path)}"
    proc = driver(cluster, "gone", tmp_path, args)
    wait_for_line(tmp_path / "gone" / "rank-0.log", r"restart 0 step 5\b", proc)
    cluster.remove_node(_node_of_rank(cluster, tmp_path, "gone", 1))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 2, out[-5000:]
    assert "restart 1 of 1 after: rank" in out
    # named as the node it was, not as a process that exited
    assert re.search(r"its node \S+ \(node id [0-9a-f]{8}\) was lost: .* it took rank\(s\) 1 with it", out)
    last = out.splitlines()[-2] + out.splitlines()[-1]
    assert "not placed within 5s" in last
    assert re.search(r"left out: the node\(s\) this job lost, \S+ \(node id [0-9a-f]{8}\)", last), last  # #46
    assert leftovers("gone") == ([], [])
    cluster.add_node(**NODE)  # leave the cluster as the other tests found it


def wait_for_spares(job: str, count: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until `count` spares run beside the job's `count` ranks, in its groups (all unnamed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ids = {g["placement_group_id"] for g in ray.util.placement_group_table().values()
               if g["name"].startswith(f"{job}-node") and g["state"] == "CREATED"}  # fmt: skip
        alive = list_actors(address=connected(), filters=[("state", "=", "ALIVE")], limit=10000, detail=True)
        if sum(a.class_name == "RankActor" and a.placement_group_id in ids for a in alive) == 2 * count:
            return
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    raise AssertionError(f"the spares of {job} never started")


def _loop(tmp_path: Path) -> Path:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    return script


def test_stopping_a_job_with_warm_spares_leaves_nothing(cluster, tmp_path):
    args = f"--nodes 2 --gpus-per-node 1 --max-restarts 1 {_loop(tmp_path)}"
    proc = driver(cluster, "stopspares", tmp_path, args)
    wait_for_spares("stopspares", 2, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-4000:]
    assert leftovers("stopspares") == ([], [])


def test_nodes_min_max_starts_on_what_the_cluster_holds_and_goes_on_with_fewer_after_a_lost_node(
    cluster, tmp_path
):
    """`--nodes 1:3` on a cluster of 2 nodes that can hold a group: after --placement-timeout it runs on
    2, TP 2 x DP 2 (the global batch kept for every size); a node lost with no replacement relaunches
    at once on the one left, which resumes from the last checkpoint at DP 1; exit 0, nothing left.
    Last in this module: it leaves the cluster a node short.

    The ranks are held still (SIGSTOP: a stopped rank is not a lost node) from the first checkpoint
    until megaray relaunches, so the run cannot end before the lost node is found, however fast the
    machine: it ran 25 steps of a global batch of 48 (20 of them at DP 1, 12 micro-batches a rank) to
    leave a fast one room; 24 is the least that DP 1, 2 and 3 each divide into micro-batches of 4."""
    runs, ckpt, said = tmp_path / "runs", tmp_path / "ckpt", tmp_path / "driver.out"
    job, steps = "elastic", 15
    args = (
        "--nodes 1:3 --gpus-per-node 2 --max-restarts 1 --no-spares --placement-timeout 5 "
        f"--dry-run steps={steps} save={ckpt} save_every=5 tp=2 pp=1 global_batch=24"
    )
    proc = driver(cluster, job, runs, args, log=said)
    wait_for_line(runs / job / "rank-0.log", r"saved checkpoint at iteration 5\b", proc, timeout_s=240)
    topology = json.loads((runs / job / "topology.json").read_text())
    held = [r["pid"] for r in topology["ranks"]]
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        assert topology["nodes"] == {
            "asked": "1:3", "running": 2, "why": "2 of 3 node(s): the cluster holds 2"
        } and len(topology["ranks"]) == 4  # fmt: skip
        cluster.remove_node(_node_of_rank(cluster, runs, job, 3))
        wait_for_line(said, r"restart 1 of 1 after", proc)
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    proc.wait(timeout=300)
    out = said.read_text()
    assert proc.returncode == 0, out[-5000:]
    assert "restart 1 of 1 after: rank" in out and "at least 1" in out, out[-5000:]
    assert "job elastic runs on 1 of 3 node(s)" in out, out[-5000:]
    log = (runs / job / "rank-0.log").read_text()
    before, after = log.split("resumed from checkpoint at iteration ")
    resumed = int(after.split()[0])
    assert after.split("\n")[0].endswith("at DP 1 (saved at DP 2)"), after[:200]
    assert resumed == max(int(n) for n in re.findall(r"saved checkpoint at iteration (\d+)", before))
    topology = json.loads((runs / job / "topology.json").read_text())
    assert topology["nodes"]["running"] == 1 and len(topology["ranks"]) == 2
    trained = re.search(r"TP 2 x PP 1 x DP 1: loss [\d.]+ -> [\d.]+ over (\d+) steps", out)
    assert trained and int(trained.group(1)) == steps - resumed, out[-3000:]
    assert leftovers(job) == ([], [])
