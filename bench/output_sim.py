"""The output path at thousands of ranks, simulated on this machine (issue #31): megaray's own
sink (driver/output/sink.py `OutputSink`) and node forwarders (rank/forwarder.py `NodeForwarder`),
unchanged, with Ray's calls between them replaced by pipes that keep Ray's semantics for them.

- the sink runs in a process of its own, one call at a time in arrival order (as in the driver's
  node's forwarder, which holds it: its sink calls never await), each call paying `--rpc-ms` on the
  way;
- one process holds every node's forwarder (asyncio, as in the Ray async actor) and every rank: a
  rank's spool grows by the clock at `--lines-per-s` whatever the simulation keeps up with (a spool
  is a file on the rank's node: its backlog is disk, not memory), and its sender keeps one write in
  flight to its node's forwarder, as rank/capture.py does;
- the driver (this process) drains the sink every 0.25 s as supervision does, and measures how old
  the console rank's lines are when they reach the console.

At the end every rank's log in the run directory is counted against what the rank wrote.

Not simulated: placement, actor start-up, supervision and teardown (bench/control_plane.py measures
those on real simulated nodes, up to 128 ranks), Ray's object store for large arguments, the
network between nodes.

    python bench/output_sim.py --ranks 8192 --lines-per-s 1 --seconds 20

The last line is machine-readable.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.core.outbatch import Source

FILLER = b"x" * 71 + b"\n"  # a typical log line's length
DRAIN_EVERY_S = 0.25  # driver/supervision/supervise.py POLL_S
GATHER_S = 0.03  # rank/capture.py PUMP_GATHER_S


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- the sink's process: _serve_two, below ------------------------------------------------------
class Pipe:
    """Calls to the sink's process from any thread or event loop; replies come back by call id."""

    def __init__(self, conn, rpc_ms: float):
        self.conn, self.delay = conn, rpc_ms / 1000
        self.lock = threading.Lock()
        self.next_id = 0
        self.waiting: dict[int, tuple[asyncio.AbstractEventLoop | None, object]] = {}
        threading.Thread(target=self._replies, daemon=True).start()

    def _replies(self) -> None:
        while True:
            try:
                call_id, result = self.conn.recv()
            except EOFError:
                return
            loop, fut = self.waiting.pop(call_id)
            if loop is None:
                fut.set_result(result)  # a concurrent.futures.Future
            else:
                loop.call_soon_threadsafe(fut.set_result, result)

    def _send(self, method: str, args: tuple, loop, fut) -> None:
        with self.lock:
            call_id, self.next_id = self.next_id, self.next_id + 1
            self.waiting[call_id] = (loop, fut)
            self.conn.send((call_id, method, args))

    def call(self, method: str, *args):
        from concurrent.futures import Future

        fut: Future = Future()
        time.sleep(self.delay)
        self._send(method, args, None, fut)
        return fut.result()

    async def acall(self, method: str, *args):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        await asyncio.sleep(self.delay)
        self._send(method, args, loop, fut)
        return await fut


class SinkHandle:
    """What NodeForwarder sees as the sink: `sink.take.remote(batch)`, awaited."""

    def __init__(self, pipe: Pipe):
        self.pipe = pipe

    @property
    def take(self):
        pipe = self.pipe

        class _Method:
            @staticmethod
            def remote(batch):
                return pipe.acall("take", batch)

        return _Method


# -- the nodes' process ------------------------------------------------------------------------------
async def rank_sender(forwarder, rank: int, rate: float, stop: asyncio.Event, stamp: bool, written: dict):
    """One rank: its spool grows by the clock; one write in flight to its node's forwarder."""
    t0 = time.monotonic()
    made = sent = 0  # lines
    offset = 0
    while not stop.is_set():
        await asyncio.sleep(max(GATHER_S, 1 / rate))
        due = int((time.monotonic() - t0) * rate)
        n = due - made
        if n <= 0:
            continue
        made = due
        head = f"t={time.time():.3f} r{rank}\n".encode() if stamp else FILLER
        data = head + FILLER * (n - 1)
        await forwarder.write(Source(rank), data, offset)
        offset += len(data)
        sent += n
    written[rank] = sent


def nodes_process(conn, go, stop_flag, done, ranks: int, per_node: int, console, rate, rpc_ms) -> None:
    from launcher.rank.forwarder import NodeForwarder

    async def main() -> dict:
        while not go.is_set():  # the ranks' actors are starting
            await asyncio.sleep(0.05)
        pipe = Pipe(conn, rpc_ms)
        nodes = ranks // per_node
        forwarders = [NodeForwarder(SinkHandle(pipe), console, nodes) for _ in range(nodes)]
        stop = asyncio.Event()
        written: dict[int, int] = {}
        tasks = [
            asyncio.create_task(rank_sender(forwarders[r // per_node], r, rate, stop, r in console, written))
            for r in range(ranks)
        ]
        while not stop_flag.is_set():
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*tasks)
        t = time.monotonic()
        await asyncio.gather(*(f.flush() for f in forwarders))
        held = max(f.held.bytes for f in forwarders)
        return {"lines": sum(written.values()), "flush_s": time.monotonic() - t, "held_at_end": held}

    result = asyncio.run(main())
    done.put({**result, "cpu_s": _cpu_s(), "peak_rss_mb": _peak_rss_mb()})


# -- the driver ---------------------------------------------------------------------------------------
def simulate(ranks: int, per_node: int, rate: float, seconds: float, rpc_ms: float, startup_s: float) -> dict:
    run_dir = tempfile.mkdtemp(prefix="megaray-output-sim-")
    ctx = mp.get_context("spawn")
    node_of_rank = [r // per_node for r in range(ranks)]
    console = frozenset({0})
    # the nodes and the driver share the sink; their calls are sent on two pipes
    sink_nodes, nodes_end = ctx.Pipe()
    sink_driver, driver_end = ctx.Pipe()
    sinks = [ctx.Process(target=_serve_two, args=(sink_nodes, sink_driver, run_dir, node_of_rank, console))]
    go, stop_flag, done = ctx.Event(), ctx.Event(), ctx.Queue()
    nodes = ctx.Process(
        target=nodes_process, args=(nodes_end, go, stop_flag, done, ranks, per_node, console, rate, rpc_ms)
    )
    for p in [*sinks, nodes]:
        p.start()
    pipe = Pipe(driver_end, rpc_ms)
    pipe.call("drain")  # the sink is up (in a launch: at placement, before any rank actor starts)
    time.sleep(startup_s)  # the ranks' actors start (Ray: ~550 a second; 15 s for 8,192)
    go.set()
    cpu0, t0 = _cpu_s(), time.monotonic()
    lags: list[float] = []
    console_lines = 0
    while time.monotonic() - t0 < seconds:
        time.sleep(DRAIN_EVERY_S)
        lines, _records, _writes = pipe.call("drain")
        now = time.time()
        for _, line in lines:
            console_lines += 1
            if "] t=" in line:
                lags.append(now - float(line.split("] t=", 1)[1].split()[0]))
    stop_flag.set()
    nodes_result = done.get()
    t_end = time.monotonic()
    _, _, sink = pipe.call("finish")
    for p in [*sinks, nodes]:
        p.join(timeout=60)
    driver_cpu = _cpu_s() - cpu0
    logged = sum(f.read_bytes().count(b"\n") for f in Path(run_dir).glob("rank-*.log"))
    shutil.rmtree(run_dir, ignore_errors=True)
    wall = t_end - t0
    return {
        "ranks": ranks,
        "nodes": ranks // per_node,
        "lines_per_s": rate,
        "wall_s": round(wall, 2),
        "written": nodes_result["lines"],
        "logged": logged,
        "lost": nodes_result["lines"] - logged,
        "max_console_lag_s": round(max(lags), 3) if lags else float("nan"),
        "p50_console_lag_s": round(sorted(lags)[len(lags) // 2], 3) if lags else float("nan"),
        "driver_cpu_ms_per_rank": round(driver_cpu * 1000 / ranks, 3),
        "sink_busy": round(sink["cpu_s"] / wall, 2),  # of one core
        "sink_calls_per_s": round(sink["calls"] / wall),
        "peak_sink_rss_mb": round(sink["peak_rss_mb"], 1),
        "catch_up_s": round(nodes_result["flush_s"], 2),
        "nodes_peak_rss_mb": round(nodes_result["peak_rss_mb"], 1),
    }


def _serve_two(a, b, run_dir, node_of_rank, console) -> None:
    """The sink's process with two callers (the nodes, the driver): calls served one at a time, in
    the order they arrive, as Ray's actor queue does."""
    import queue

    from launcher.driver.output.sink import OutputSink

    sink = OutputSink(run_dir, node_of_rank, console)
    calls: queue.Queue = queue.Queue()

    def reader(conn) -> None:
        while True:
            try:
                calls.put((conn, *conn.recv()))
            except EOFError:
                return

    for conn in (a, b):
        threading.Thread(target=reader, args=(conn,), daemon=True).start()
    served, cpu0 = 0, _cpu_s()  # after the imports: what serving costs
    while True:
        conn, call_id, method, args = calls.get()
        if method == "finish":
            lines, records, writes = sink.finish()
            used = {
                "writes": writes,
                "calls": served,
                "cpu_s": _cpu_s() - cpu0,
                "peak_rss_mb": _peak_rss_mb(),
            }
            conn.send((call_id, (lines, records, used)))
            return
        served += 1
        conn.send((call_id, getattr(sink, method)(*args)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--lines-per-s", type=float, default=1.0, help="each rank's output")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rpc-ms", type=float, default=1.0, help="what each call to the sink costs in transit")
    ap.add_argument(
        "--startup-s", type=float, default=3.0,
        help="from the sink's start to the ranks' first output (Ray starts ~550 actors a second)",
    )  # fmt: skip
    args = ap.parse_args()
    r = simulate(args.ranks, args.ranks_per_node, args.lines_per_s, args.seconds, args.rpc_ms, args.startup_s)
    print(" ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
