"""Real Ray clusters for the tests: a head and workers, each a `ray start --block` process of its
own on this machine, with token authentication on (a token file of the cluster's own) as Ray 2.60
clusters have it by default. Each is stopped by its pid, never with `ray stop`."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from launcher.core.rankenv import DRAIN_VAR

from .conftest import free_port, ray_starting

BIN = os.path.dirname(sys.executable)
# What `ray start` says when its raylet did not register with the GCS within Ray's fixed 30 s.
RAYLET_TIMED_OUT = "The current node timed out during startup"


class _StartTimedOut(RuntimeError):
    """A worker's `ray start` ended on RAYLET_TIMED_OUT: the harness starts it again."""


# `RayStartCluster.query`'s process: a line of JSON (the code) in, a line of JSON (its `result`, or the
# error) out, for as long as the cluster runs.
ASKER = """
import json, sys, traceback
from ray.job_submission import JobSubmissionClient
from ray.util.state import list_actors, list_nodes, list_placement_groups
URL = sys.argv[1]
for line in sys.stdin:
    scope = dict(globals())
    try:
        scope["client"] = JobSubmissionClient(URL)
        exec(json.loads(line), scope)
        answer = {"result": scope["result"]}
    except Exception:
        answer = {"error": traceback.format_exc()[-3000:]}
    print(json.dumps(answer), flush=True)
"""


@dataclass
class RayStartCluster:
    gcs: str  # HOST:PORT, for --address
    url: str  # the dashboard, for `megaray submit` and the state API
    token_path: Path
    env: dict[str, str]  # what the nodes run with (RAY_AUTH_MODE=token and the token path)
    tmp: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    _asker: subprocess.Popen | None = None  # the process that runs `query`'s code

    def query(self, code: str, timeout_s: float = 60) -> object:
        """Run `code` (which sets `result`) in a process connected to the head; return result. One
        process per cluster answers them all: a fresh one each (importing Ray's job client and state
        API, 2-3 CPU-s on 2 cores) cost the suite minutes, polled as some of these are."""
        if self._asker is None or self._asker.poll() is not None:
            self._asker = subprocess.Popen(
                [sys.executable, "-c", ASKER, self.url], env=self.env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
            )  # fmt: skip
        asker = self._asker
        asker.stdin.write(json.dumps(code) + "\n")
        asker.stdin.flush()
        ready, _, _ = select.select([asker.stdout], [], [], timeout_s)
        line = asker.stdout.readline() if ready else ""
        if not line:
            self._close_asker()
            raise AssertionError(f"no answer within {timeout_s:g}s to:\n{code}")
        answer = json.loads(line)
        assert "error" not in answer, answer.get("error")
        return answer["result"]

    def _close_asker(self) -> None:
        asker, self._asker = self._asker, None
        if asker is not None and asker.poll() is None:
            asker.kill()
            asker.wait()

    def status(self, job: str) -> str:
        return self.query(f"result = client.get_job_status({job!r}).value")

    def jobs(self) -> list[str]:
        return self.query("result = [j.submission_id for j in client.list_jobs()]")

    def alive(self, job: str) -> tuple[list, list]:
        """Actors not dead and placement groups not removed that belong to `job`, after a short grace."""
        code = f"""
import time
deadline = time.time() + 10
while True:
    mine = [g for g in list_placement_groups(address=URL, limit=10000)
            if (g.name or "").startswith({job!r} + "-")]
    ids = {{g.placement_group_id for g in mine}}  # rank actors are unnamed: theirs are the job's groups
    every = list_actors(address=URL, limit=10000, detail=True)
    actors = [a.name or a.actor_id for a in every if a.state != "DEAD"
              and ((a.name or "").startswith({job!r} + "-") or a.placement_group_id in ids)]
    groups = [g.name for g in mine if g.state != "REMOVED"]
    if not (actors or groups) or time.time() > deadline:
        break
    time.sleep(0.3)
result = [actors, groups]
"""
        actors, groups = self.query(code)
        return actors, groups

    def nodes_alive(self) -> int:
        return self.query("result = sum(n.state == 'ALIVE' for n in list_nodes(address=URL))")

    def _start(self, args: str, name: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115
        cmd = [f"{BIN}/ray", "start", "--block", "--disable-usage-stats", *args.split()]
        proc = subprocess.Popen(
            cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append(proc)
        return proc

    def add_worker(self, num_cpus: int, num_gpus: int = 0) -> subprocess.Popen:
        """One more node; returns once the head counts it. A `ray start` that gave up on its own raylet
        (Ray waits a fixed 30 s for it to register with the GCS: a CI run beside a busy module took
        longer) is started again, up to twice, once what it started (its session's processes) is gone."""
        for attempt in range(3):
            before, name = self.nodes_alive(), f"w{len(self.procs)}" + (f"-again{attempt}" if attempt else "")
            proc = self._start(
                f"--address {self.gcs} --num-cpus {num_cpus} --num-gpus {num_gpus} "
                f"--dashboard-agent-listen-port {free_port()}",
                name,
            )
            try:
                self._wait(lambda n=before: self.nodes_alive() > n, proc, name, again=attempt < 2)
                return proc
            except _StartTimedOut:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the session `ray start` began (start_new_session)
                self.procs.remove(proc)
                deadline = time.monotonic() + 60  # a raylet that registered all the same, counted dead
                while self.nodes_alive() > before and time.monotonic() < deadline:
                    time.sleep(0.5)
        raise AssertionError("unreachable: the last attempt raises")

    def _wait(self, ready, proc: subprocess.Popen, name: str, again: bool = False) -> None:
        """Until `ready()`; the cluster stopped and the node's log raised if `ray start` ends first or
        after 120 s, unless `again` and it ended on Ray's raylet start-up timeout (`_StartTimedOut`)."""
        deadline = time.monotonic() + 120
        while True:
            try:
                if ready():
                    return
            except AssertionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                said = (self.tmp / f"{name}.log").read_text()
                if again and proc.poll() is not None and RAYLET_TIMED_OUT in said:
                    raise _StartTimedOut(name)
                self.stop()
                raise RuntimeError(f"ray start ({name}) did not come up:\n" + said[-3000:])
            time.sleep(0.3)

    @staticmethod
    def stop_node(proc: subprocess.Popen) -> None:
        """`ray start --block` stops its raylet and workers when it gets SIGTERM."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        self._close_asker()
        for proc in reversed(self.procs):  # workers before the head
            self.stop_node(proc)


def start_cluster(num_cpus: int, num_gpus: int = 0, **config: str) -> RayStartCluster:
    """A head on loopback ports of its own, with the dashboard; add workers with `add_worker`.
    `config`: more variables every node starts with (Ray's `RAY_<setting>`)."""
    tmp = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))  # short: Ray's socket paths must fit
    token = tmp / "token"
    token.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    env = {
        **os.environ,
        "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),  # a job's `python` is this one
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_DEDUP_LOGS": "0",
        # a node stopped (SIGTERM to its `ray start`) goes at once, as a machine that goes away does and
        # as the nodes megaray starts do (core/rankenv.py): Ray 2.60 first drains it for up to 30 s (for
        # Ray Serve's proxies), a node running ranks all of it, and megaray's report of the node lost
        # waited for that
        DRAIN_VAR: "0",
        **config,
    }
    env.pop("RAY_ADDRESS", None)
    port, dash, agent = free_port(), free_port(), free_port()
    c = RayStartCluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}", token, env, tmp)
    with ray_starting():
        head = c._start(
            f"--head --port {port} --node-ip-address 127.0.0.1 --dashboard-host 127.0.0.1 "
            f"--dashboard-port {dash} --include-dashboard true --num-cpus {num_cpus} --num-gpus {num_gpus} "
            # ports of its own for the job agent and the client server, whose defaults (52365, 10001)
            # another Ray on this machine may hold: then no job can be submitted ("No available agent")
            f"--dashboard-agent-listen-port {agent} --ray-client-server-port {free_port()} "
            f"--temp-dir {tmp}",
            "head",
        )
        # up when the job API answers, the head's raylet has registered and its job agent listens: a
        # head still starting its agent, its GCS stopped meanwhile (test_addresses), went down whole
        # (its raylet ends with an agent that fails, and `ray start --block` then kills every process)
        c._wait(lambda: c.jobs() is not None and c.nodes_alive() == 1 and _listening(agent), head, "head")
    return c


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
