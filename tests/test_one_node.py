"""Tier 2: one Ray node started in this process, ranks over gloo, `main()` called in-process: the
torchrun contract each rank gets, scripts and entrypoints, ports, names and run directories, the
output path. How ranks fail is tests/test_rank_failures.py's."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

import pytest
import ray

from launcher.cli import main
from launcher.rank.probes import interface_of

from .conftest import REPO, free_port, launch, leftovers, read_ranks

pytestmark = pytest.mark.usefixtures("one_node")


def test_two_cpu_ranks_get_the_torchrun_contract(out, capsys):
    """The env each rank's program sees; their gloo all-reduce is the torchrun example's, below."""
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
        assert s["preloaded"] == []  # the program's imports are its own, as under torchrun
    # Ray's serializers for such libraries' types are registered once the program imports one
    assert seen[0]["arrow_registered"] in (True, None), seen[0]  # None: no pyarrow installed
    assert seen[0]["env"]["MASTER_ADDR"] == seen[1]["env"]["MASTER_ADDR"]
    port = int(seen[0]["env"]["MASTER_PORT"])
    assert 20000 <= port < 30000 and seen[1]["env"]["MASTER_PORT"] == str(port)
    err = capsys.readouterr().err
    assert "topology (MASTER_ADDR=" in err and "all 2 ranks finished" in err
    assert leftovers("envcpu") == ([], [])


@pytest.mark.slow  # the full suite runs it; the fast loop (2 minutes) launches this way elsewhere
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


def _sockets_on(port: int) -> list[tuple[str, str, str]]:
    """The TCP sockets whose local end is `port` (/proc/net/tcp and tcp6): local, remote, state (hex:
    06 TIME-WAIT, 0A listening, 01 established)."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            rows += [line.split() for line in Path(table).read_text().splitlines()[1:]]
    return [(row[1], row[2], row[3]) for row in rows if row[1].endswith(f":{port:04X}")]


def _time_wait_on(port: int) -> bool:
    """A TCP connection in TIME-WAIT whose local end is `port`."""
    return any(state == "06" for _, _, state in _sockets_on(port))


@pytest.mark.slow  # the full suite runs it; the fast loop (2 minutes) launches this way elsewhere
def test_a_master_port_left_in_time_wait_by_the_last_run_is_taken_as_under_torchrun(out, capsys):
    """Rerunning a command at once: the last run's store connections linger in TIME-WAIT on the port
    (the side that closed first keeps it a minute); torch's store binds it all the same
    (SO_REUSEADDR), and so does megaray."""
    import socket

    # a port outside the kernel's ephemeral range, as a user's (29500) is: one the kernel picks (bind
    # to 0) was refused once in a fresh-clone run, 13 s into the launch on a loaded machine, with its
    # TIME-WAIT seen before the launch (what held it then is not known; the sockets on it are named
    # below should it happen again)
    port = free_port()
    listener = socket.create_server(("0.0.0.0", port))
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
    assert code == 0, f"{capsys.readouterr().err[-3000:]}\nsockets on {port}: {_sockets_on(port)}"
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


@pytest.mark.slow  # the fast loop's script test sees a profile (efa) reach every rank
@pytest.mark.parametrize("profile", ["efa", "infiniband", "tcp", "cpu"])
def test_each_env_profile_reaches_every_rank(profile, tmp_path):
    from launcher.core.profiles import load_profile

    out = tmp_path / "out"
    assert launch(f"profile-{profile}", "--device", "cpu", "--gpus-per-node", "2", "--env-profile", profile,
                  "--entrypoint", "tests.targets:dump_profile", out=out) == 0  # fmt: skip
    want = load_profile(profile)
    for seen in read_ranks(out, "profile", 2):
        assert {k: seen[k] for k in want} == want


def test_the_torchrun_example_runs_unchanged_and_two_cpu_ranks_all_reduce(tmp_path, capfd):
    assert launch("example", "--device", "cpu", "--gpus-per-node", "2", "--runs-dir", str(tmp_path),
                  "examples/torchrun_script.py", "--steps", "2") == 0  # fmt: skip
    said = {0: capfd.readouterr().out, 1: (tmp_path / "example" / "rank-1.log").read_text()}
    for rank, out in said.items():  # rank 0's line on the console, each in its log: both got the sum
        assert re.search(rf"rank {rank}/2 local_rank {rank} .* device=cpu \(cpu\) sum=1 expected=1", out), out


def test_runs_dir_that_is_a_file_exits_2_at_once(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    assert launch("runsfile", "--runs-dir", str(blocker), "--dry-run") == 2
    err = capsys.readouterr().err
    assert f"--runs-dir {blocker} cannot hold run directories (a file is in the way)" in err
    assert "Traceback" not in err


@pytest.mark.slow  # the full suite runs it; the fast loop (2 minutes) launches this way elsewhere
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


class Cycle:  # garbage the collector has not met when the program ends: finalized at its end
    def __del__(self):
        open(os.path.join(out, f"finalized-{rank}"), "w").write("done")


import gc
gc.set_threshold(1_000_000_000)  # no collection before the end: the collector is on, never triggered
cycle = Cycle()
cycle.me = cycle
del cycle
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
        # a rank's end is made cheap (rank/teardown.py): what is garbage by then is still finalized
        assert sorted(p.name for p in out.iterdir()) == [
            *(f"{k}-{r}" for k in ("atexit", "finalized", "thread") for r in range(2))
        ], launcher
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


@pytest.mark.slow  # the full suite runs it; the fast loop (2 minutes) launches this way elsewhere
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
        # eight Ray workers start here (six ranks, the sink, the forwarder) beside the other xdist
        # worker's tests: 72 s on a machine half as fast as usual (sum(i*i) over 10**7 in 1.0 CPU-s)
        # with a 60 s bound, which failed the run; how fast they start is not what is tested
        ray.get(
            [r.start.remote(forwarder, i, str(tmp_path / f"spool-{i}")) for i, r in enumerate(ranks)],
            timeout=300,
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
    """Whether Ray says the actor died. One that does not answer within the second is not counted as
    dead: a live one on a loaded machine can be that slow, and the test would pass without a stop."""
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=1)
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        pass  # slow, not dead
    return False


@pytest.mark.slow  # the full suite runs it; the fast loop (2 minutes) launches this way elsewhere
def test_a_slow_sink_slows_the_sending_not_the_program_and_loses_nothing(tmp_path):
    """Two ranks flood a sink that takes half a second a call, through their node's forwarder: one
    batch in flight for the node, one write in flight per rank, the rest waits in the spools and goes
    in the next batch; every line reaches each rank's log."""
    from launcher.driver.output.relay import _forwarder_class
    from launcher.driver.output.sink import OutputSink

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


def test_a_pools_output_sink_ends_itself_once_its_pool_is_given_back_unless_a_launch_took_it(tmp_path):
    """A pool's sink is detached: nothing a launch does ends it, so it watches its pool's group (one
    outlived `megaray down` in a CI run)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from launcher.driver.output.relay import start_sink

    group = placement_group([{"CPU": 0.01}], name="sinkpool-node0")
    ray.get(group.ready(), timeout=30)
    idle = start_sink("sinkpool-idle-0", detached=True).remote(pool_group="sinkpool-node0")
    taken = start_sink("sinkpool-taken-0", detached=True).remote(pool_group="sinkpool-node0")
    ray.get(taken.configure.remote(str(tmp_path / "run"), [0], frozenset({0})), timeout=30)
    assert ray.get([idle.received_of.remote([]), taken.received_of.remote([])], timeout=30) == [[], []]
    remove_placement_group(group)
    assert leftovers("sinkpool-idle", wait_s=20) == ([], [])  # it ended itself
    assert leftovers("sinkpool-taken", wait_s=0) == (["sinkpool-taken-0"], [])
    ray.kill(taken, no_restart=True)
    assert leftovers("sinkpool") == ([], [])
