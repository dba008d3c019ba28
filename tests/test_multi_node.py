"""Tier 3: several simulated nodes (`ray.cluster_utils.Cluster`) with declared GPUs, and drivers run
as separate processes the way users run them."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launcher.cli import main
from launcher.driver.cluster.cluster import SIMULATED_NODE, stop_simulated

from . import drive
from .conftest import REPO, leftovers, read_ranks, simulated_cluster

CPU_TWO_NODES = "--device cpu --nodes 2 --gpus-per-node 1"
NODE_A_ENV = {"OMP_NUM_THREADS": "3", "NCCL_DEBUG": "INFO"}


@pytest.fixture(scope="module")
def cluster():
    os.chdir(REPO)
    # Node A has 3 GPUs (one of them taken by someone else below) and its own environment.
    c = simulated_cluster(
        {"include_dashboard": True},
        [
            dict(num_cpus=4, num_gpus=3, resources={"node_a": 1}, env_vars=NODE_A_ENV, **SIMULATED_NODE),
            dict(num_cpus=4, num_gpus=2, resources={"node_b": 1}, **SIMULATED_NODE),
        ],
    )
    ray.init(address=c.address, namespace="megaray")
    yield c
    ray.shutdown()
    stop_simulated(c)  # as megaray stops its own: a second of Ray's stop saved


@ray.remote(num_gpus=1, num_cpus=0)
def _gpu_ids():
    return [str(g) for g in ray.get_runtime_context().get_accelerator_ids()["GPU"]]


def launch(cluster, job, out, args: str) -> int:
    return main(
        ["--job-name", job, "--address", cluster.address, "--env", f"MEGARAY_TEST_OUT={out}", *args.split()]
    )


def node_ids():
    return {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}


def test_rank_order_and_local_rank_selects_the_ray_gpu(cluster, out, capsys):
    # Another user holds one GPU of node A, so our GPUs there are not 0 and 1 in bundle order.
    blocker = placement_group([{"GPU": 1, "node_a": 0.1}])
    ray.get(blocker.ready())
    taken = ray.get(_gpu_ids.options(scheduling_strategy=PlacementGroupSchedulingStrategy(blocker)).remote())
    try:
        assert (
            launch(cluster, "order", out, "--nodes 2 --gpus-per-node 2 --entrypoint tests.targets:dump_env")
            == 0
        )
    finally:
        remove_placement_group(blocker)
    seen = read_ranks(out, "env", 4)
    nodes = node_ids()
    node_a = next(i for i, n in nodes.items() if "node_a" in n["Resources"])
    # Both simulated nodes share one IP: the tie-break by node id decides, so rank order is stable.
    expected_first = min(s["node_id"] for s in seen)
    assert [s["node_id"] == expected_first for s in seen] == [True, True, False, False]
    for rank, s in enumerate(seen):
        e = s["env"]
        assert (e["RANK"], e["NODE_RANK"], e["LOCAL_RANK"]) == (str(rank), str(rank // 2), str(rank % 2))
        visible = e["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[int(e["LOCAL_RANK"])] == s["ray_gpu_ids"][0]
        assert e["MASTER_ADDR"] == seen[0]["env"]["MASTER_ADDR"]
    on_a = [s for s in seen if s["node_id"] == node_a]
    assert len(on_a) == 2
    assert taken[0] not in on_a[0]["env"]["CUDA_VISIBLE_DEVICES"].split(",")
    assert on_a[0]["env"]["CUDA_VISIBLE_DEVICES"] == on_a[1]["env"]["CUDA_VISIBLE_DEVICES"]
    err = capsys.readouterr().err
    assert err.count("rank  node  ip") == 1
    assert leftovers("order") == ([], [])


def test_node_env_is_kept_or_replaced_loudly(cluster, out, capsys):
    assert (
        launch(
            cluster,
            "nodeenv",
            out,
            "--nodes 2 --gpus-per-node 2 --env NCCL_DEBUG=TRACE --entrypoint tests.targets:dump_env",
        )
        == 0
    )
    nodes = node_ids()
    for s in read_ranks(out, "env", 4):
        on_a = "node_a" in nodes[s["node_id"]]["Resources"]
        assert s["env"]["OMP_NUM_THREADS"] == ("3" if on_a else "1")
        assert s["env"]["NCCL_DEBUG"] == "TRACE"
    err = capsys.readouterr().err
    assert "OMP_NUM_THREADS: keeping the node's '3' (launcher default '1')" in err
    assert "NCCL_DEBUG: --env sets its value over the node's 'INFO'" in err


def _driver(cluster, job, args: str, out=None):
    extra = ["--env", f"MEGARAY_TEST_OUT={out}"] if out else []
    return drive.start(
        "--job-name", job, "--address", cluster.address, *extra, *args.split(),
        env=drive.user_env(PYTHONUNBUFFERED="1"),
    )  # fmt: skip


def test_two_jobs_at_once_get_different_ports_and_both_succeed(cluster, tmp_path):
    args = f"{CPU_TWO_NODES} --entrypoint tests.targets:gloo_allreduce"
    a = _driver(cluster, "twin-a", args, out=tmp_path / "a")
    b = _driver(cluster, "twin-b", args, out=tmp_path / "b")
    out_a, out_b = a.communicate(timeout=180)[0], b.communicate(timeout=180)[0]
    assert (a.returncode, b.returncode) == (0, 0), out_a + out_b
    ports = {json.loads((tmp_path / j / "allreduce-rank0.json").read_text())["port"] for j in ("a", "b")}
    assert len(ports) == 2
    for j in ("a", "b"):
        assert [r["sum"] for r in read_ranks(tmp_path / j, "allreduce", 2)] == [1.0, 1.0]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_driver_stops_every_rank(cluster, tmp_path, sig, code):
    """Ctrl-C or SIGTERM: every rank gets SIGTERM and --kill-grace to end on it (a save of 2 s
    completes), as after a rank's failure; then nothing is left."""
    job = f"sig{int(sig)}"
    p = _driver(cluster, job, f"{CPU_TWO_NODES} --entrypoint tests.targets:save_on_sigterm", out=tmp_path)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"pid-rank{r}.json").exists() for r in range(2)):
        assert p.poll() is None and time.monotonic() < deadline, (
            p.stdout.read() if p.poll() is not None else ""
        )
        time.sleep(0.1)
    p.send_signal(sig)
    output = p.communicate(timeout=30)[0]
    assert p.returncode == code, output
    assert f"interrupted by {signal.Signals(sig).name}" in output
    saved = [json.loads((tmp_path / f"saved-rank{r}.json").read_text()) for r in range(2)]
    assert saved == [{"signal": signal.SIGTERM}] * 2
    assert leftovers(job) == ([], [])
    for r in range(2):
        pid = json.loads((tmp_path / f"pid-rank{r}.json").read_text())["pid"]
        _wait_gone(pid)


def _wait_gone(pid: int, wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"rank process {pid} still running {wait_s}s after the driver stopped")


def test_launch_from_python_returns_every_rank_and_raises_the_root_cause(cluster, out):
    from launcher import RankFailedError, launch, spec_from_args

    args = [
        "--address",
        cluster.address,
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--env",
        f"MEGARAY_TEST_OUT={out}",
    ]
    result = launch(spec_from_args([*args, "--job-name", "api", "--entrypoint", "tests.targets:dump_env"]))
    assert result.returns == (0, 1, 2, 3)
    assert [(r.rank, r.node_rank, r.local_rank) for r in result.ranks] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert result.master_addr == result.ranks[0].node_ip and result.timings["finished"] > 0
    with pytest.raises(RankFailedError) as err:
        launch(
            spec_from_args([*args, "--job-name", "apifail", "--entrypoint", "tests.targets:fail_on_rank_1"])
        )
    assert err.value.root.rank == 1 and "rank one refuses on purpose" in err.value.report()
    assert leftovers("api") == ([], []) and leftovers("apifail") == ([], [])


def test_rank_group_runs_many_calls_on_the_same_actors_and_frees_everything(cluster):
    import gc

    from launcher import RankGroup

    from .targets import item_and_rank, whoami

    group = RankGroup(nodes=2, gpus_per_node=2, address=cluster.address, job_name="group")
    first, second = group.run_all(whoami, tag="a"), group.run_all(whoami, tag="b")
    assert [w["rank"] for w in first] == [0, 1, 2, 3] and {w["world"] for w in first} == {4}
    assert [w["actor"] for w in first] == [w["actor"] for w in second]  # the same actors, not new ones
    assert [w["tag"] for w in second] == ["b"] * 4
    assert [r["item"] for r in group.run_each(item_and_rank, ["w", "x", "y", "z"])] == ["w", "x", "y", "z"]
    tied = group.run_each(item_and_rank, ["tp0", "tp1"], group_size=2)  # one result per group, its leader's
    assert tied == [{"item": "tp0", "rank": 0}, {"item": "tp1", "rank": 2}]
    with pytest.raises(ValueError, match="world size 4 / group size 2 = 2 items, got 3"):
        group.run_each(item_and_rank, [1, 2, 3], group_size=2)
    group.shutdown()
    group.shutdown()  # idempotent
    assert leftovers("group") == ([], [])

    dropped = RankGroup(nodes=1, gpus_per_node=2, address=cluster.address, job_name="dropped")
    assert len(dropped.run_all(whoami)) == 2
    del dropped
    gc.collect()
    assert leftovers("dropped") == ([], [])


def test_colocated_rank_groups_take_turns_on_the_same_gpus(cluster):
    from launcher import RankGroup

    from .targets import whoami

    def gpus(group):
        return [(r.node_ip, r.gpu, r.rank) for r in group.ranks]

    trainer = RankGroup(nodes=2, gpus_per_node=2, address=cluster.address, job_name="trainer", gpu_share=0.5)
    with pytest.raises(ValueError, match=r"gpu_share 0\.75 exceeds the 0\.5 left"):
        RankGroup(nodes=2, gpus_per_node=2, colocate_with=trainer, gpu_share=0.75)
    generator = RankGroup(
        nodes=2, gpus_per_node=2, job_name="generator", gpu_share=0.5, colocate_with=trainer
    )
    assert gpus(generator) == gpus(trainer)  # rank for rank, the same node and GPU
    assert [w["rank"] for w in generator.run_all(whoami)] == [w["rank"] for w in trainer.run_all(whoami)]
    generator.shutdown()
    assert leftovers("generator") == ([], [])
    assert len(trainer.run_all(whoami)) == 4  # the host keeps its groups and actors
    trainer.shutdown()
    assert leftovers("trainer") == ([], [])


CHATTY = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"hello from rank {rank}")
print(f"stderr of rank {rank}", file=sys.stderr)
os.system(f"echo from a child process of rank {rank}")  # file descriptors are captured, not sys.stdout
sys.stdout.flush()
said = os.path.join(os.environ["MEGARAY_TEST_OUT"], "said-{}")
open(said.format(rank), "w").close()
if rank == 3 and os.environ.get("FAIL_LAST"):
    # once every rank has printed (on a busy machine rank 0 may start after this one): what was printed
    # before a failure reaches the console
    deadline = time.monotonic() + 60
    while not all(os.path.exists(said.format(r)) for r in range(4)) and time.monotonic() < deadline:
        time.sleep(0.05)
    raise RuntimeError("rank three gives up")
"""


def launch_chatty(cluster, tmp_path, job: str, extra: str) -> tuple[int, Path]:
    """CHATTY on 2 nodes x 2 ranks with its run directories under tmp_path; (exit code, runs dir)."""
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    runs = tmp_path / "runs"
    return launch(
        cluster, job, tmp_path, f"--nodes 2 --gpus-per-node 2 --runs-dir {runs} {extra} {script}"
    ), runs


def test_rank_output_goes_to_per_rank_files_and_rank_0_to_the_console(cluster, tmp_path, capsys):
    code, runs = launch_chatty(cluster, tmp_path, "chatty", "--env HF_TOKEN=hunter2-secret")
    assert code == 0
    out, err = capsys.readouterr()
    assert "[r0 n0] hello from rank 0" in out and "[r0 n0] from a child process of rank 0" in out
    assert "[r0 n0] stderr of rank 0" in err and "stderr of rank" not in out  # as torchrun's streams
    assert "rank 1" not in out and "[r3" not in out  # only rank 0 on the console by default
    run = runs / "chatty"
    for rank in range(4):
        text = (run / f"rank-{rank}.log").read_text()
        tag = f"[r{rank} n{rank // 2}] "
        lines = text.splitlines()
        for what in ("hello from rank", "stderr of rank", "from a child process of rank"):
            assert f"{tag}{what} {rank}" in lines, text
    # the run directory: spec, topology, env per rank, summary; the planted secret nowhere
    spec = json.loads((run / "spec.json").read_text())
    assert spec["nodes"] == 2 and spec["world_size"] == 4 and spec["env"]["HF_TOKEN"] == "<redacted>"
    topo = json.loads((run / "topology.json").read_text())
    assert [(r["rank"], r["node_rank"], r["gpu"]) for r in topo["ranks"]][:2] == [(0, 0, "0"), (1, 0, "1")]
    assert topo["master_addr"] == topo["ranks"][0]["node_ip"]
    envs = json.loads((run / "env.json").read_text())
    assert [e["rank"] for e in envs] == [0, 1, 2, 3]
    assert envs[2]["set_by_megaray"]["RANK"] == "2" and envs[2]["process"]["HF_TOKEN"] == "<redacted>"
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"], summary["world_size"]) == ("succeeded", 0, 4)
    for f in run.iterdir():
        assert "hunter2" not in f.read_text(), f
    assert "hunter2" not in out + err


def test_log_ranks_all_and_a_failure_summary(cluster, tmp_path, capsys):
    code, runs = launch_chatty(cluster, tmp_path, "chatty-fail", "--log-ranks all --env FAIL_LAST=1")
    assert code == 1
    out = capsys.readouterr().out
    for rank in range(4):
        assert f"[r{rank} n{rank // 2}] hello from rank {rank}" in out
    summary = json.loads((runs / "chatty-fail" / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("failed", 1)
    assert summary["root_cause"].startswith("rank 3 on ") and "rank three gives up" in summary["root_cause"]
    assert "[r3 n1] hello from rank 3" in (runs / "chatty-fail" / "rank-3.log").read_text()
    assert leftovers("chatty-fail") == ([], [])


def test_doctor_reports_each_node_and_flags_one_short_of_gpus(cluster, capsys):
    assert main(["doctor", "--address", cluster.address, "--nodes", "2", "--gpus-per-node", "3"]) == 1
    out, err = capsys.readouterr()
    table = out.split("nodes (3):\n")[1].split("links between nodes")[0].splitlines()
    assert len(table) == 4  # header + head node + node A + node B
    links = out.split("links between nodes (TCP, rendezvous port range):\n")[1].splitlines()
    assert [row.split()[-3:] for row in links[1:4]] == [
        ["-", "ok", "ok"],
        ["ok", "-", "ok"],
        ["ok", "ok", "-"],
    ]
    declared = sorted(int(row.split()[5]) for row in table[1:])
    assert declared == [0, 2, 3]
    assert "2 GPU(s), fewer than --gpus-per-node 3: no ranks go here" in err
    assert "--nodes 2 --gpus-per-node 3 does not fit: 1 node(s) have 3 or more GPUs" in err


@pytest.mark.alone  # it compares the nodes' bandwidth: the other worker's load made one "slow" (exit 1)
def test_doctor_measures_gloo_all_reduce_bandwidth_over_the_layout(cluster, capsys):
    assert main(["doctor", "--address", cluster.address, "--nodes", "2", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "all-reduce over 4 ranks (gloo):" in out
    sweep = out.split("all-reduce over 4 ranks (gloo):\n")[1].split("per node:")[0].splitlines()[1:]
    assert sweep and all(re.search(r"\d+(\.\d+)? [KM]iB\s+[\d.]+ ms\s+[\d.]+ GB/s", row) for row in sweep)
    per_node = out.split("per node:\n")[1].splitlines()[1:3]
    assert [row.split()[0] for row in per_node] == ["0", "1"]
    assert leftovers("megaray") == ([], [])


def test_each_node_group_gets_a_ray_node_of_its_own(cluster, out, capsys):
    # The head has 1 CPU, nodes A and B 4 each: room for four 1-CPU groups on A alone, but the node
    # groups must land on distinct Ray nodes: three fit, a fourth has nowhere to go.
    args = "--device cpu --gpus-per-node 1 --placement-timeout 5 --entrypoint tests.targets:dump_env"
    assert launch(cluster, "distinct3", out, f"--nodes 3 {args}") == 0
    seen = read_ranks(out, "env", 3)
    assert len({s["node_id"] for s in seen}) == 3
    assert launch(cluster, "distinct4", out, f"--nodes 4 {args}") == 2
    err = capsys.readouterr().err
    assert "not placed within 5s on 4 distinct nodes" in err
    assert leftovers("distinct3") == ([], []) and leftovers("distinct4") == ([], [])


def test_cluster_ranks_get_the_shells_variables_but_not_its_sessions(cluster, tmp_path, monkeypatch):
    # Exported in the launching shell only (the nodes started without them): as test_demo's local run.
    from .test_demo import ENV_PROBE, SHELL_VARS, expected_env

    for k, v in SHELL_VARS.items():
        monkeypatch.setenv(k, v)
    script = tmp_path / "probe.py"
    script.write_text(ENV_PROBE)
    args = f"--device cpu --nodes 2 --runs-dir {tmp_path} {script} {tmp_path}"
    assert launch(cluster, "envpolicy", tmp_path, args) == 0
    for rank in (0, 1):
        assert json.loads((tmp_path / f"env-{rank}.json").read_text()) == expected_env(rank)
