"""megaray's real driver at thousands of ranks, on this machine: `launch()` (the controller,
placement, the rank actors' start, the env of every rank, the output sink and the nodes'
forwarders, supervision, the liveness probes, failure reports, teardown) against a stand-in for Ray
(bench/simray.py: what it charges and what it does not simulate is said there). Issue #31.

    python bench/scale_sim.py --ranks 8192                   # a run that succeeds
    python bench/scale_sim.py --ranks 8192 --fail rank       # rank 1000 raises halfway
    python bench/scale_sim.py --ranks 8192 --fail node       # a node stops answering halfway

It reports the launch's phases, the driver's CPU (its main thread: the simulated cluster's threads
share the process), the synchronous GCS round trips per node by kind, the console's lag behind
rank 0's lines, what the console printed (lines, and for a failure the report's lines), and the
process's peak memory (driver and simulated cluster together). The last line is machine-readable.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


class ConsoleCount(logging.Handler):
    """What megaray's log puts on the console: counted, and the last failure report kept."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = 0
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)
        self.lines += text.count("\n") + 1
        self.records.append(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--lines-per-s", type=float, default=1.0, help="each rank's output")
    ap.add_argument("--run-s", type=float, default=20.0, help="how long the ranks' program runs")
    ap.add_argument("--gcs-ms", type=float, default=1.0, help="a synchronous GCS round trip")
    ap.add_argument("--call-ms", type=float, default=0.5, help="an actor call in transit")
    ap.add_argument("--actors-per-s", type=float, default=550.0, help="Ray's actor scheduling rate")
    ap.add_argument("--fail", choices=("none", "rank", "node"), default="none")
    ap.add_argument("--show", action="store_true", help="print megaray's console too")
    args = ap.parse_args()

    import simray

    sim = simray.SIM
    sim.gcs_s, sim.call_s, sim.actor_gap_s = args.gcs_ms / 1000, args.call_ms / 1000, 1 / args.actors_per_s
    nodes = args.ranks // args.per_node
    sim.add_nodes(nodes, {"GPU": float(args.per_node), "CPU": float(2 * args.per_node)})
    simray.install()
    simray.SimRank.lines_per_s, simray.SimRank.run_s = args.lines_per_s, args.run_s
    failing_rank = min(1000, args.ranks - 1)
    if args.fail == "rank":
        simray.SimRank.fail = staticmethod(lambda r: "raise" if r.rank == failing_rank else None)

    from launcher.core.errors import MegarayError
    from launcher.core.launch_args import spec_from_args
    from launcher.driver.lifecycle.launch import launch
    from launcher.driver.output import progress_view

    states: dict[str, tuple[float, float]] = {}  # state -> (driver CPU, wall) when it was entered
    synced: Counter[str] = Counter()  # the GCS round trips before the ranks ran
    lags: list[float] = []
    shown = progress_view.ProgressView.print_lines

    def print_lines(self, lines: list[tuple[int, str]]) -> None:
        now = time.time()
        for _, line in lines:
            if "] t=" in line and list(states)[-1:] == ["running"]:  # not the last lines, after a stop
                lags.append(now - float(line.split("] t=", 1)[1].split()[0]))
                if os.environ.get("SCALE_SIM_LAGS"):
                    print(f"lag {time.monotonic() - t0:.1f} {lags[-1]:.3f}", file=sys.stderr)
        if args.show:
            shown(self, lines)

    progress_view.ProgressView.print_lines = print_lines
    entered = progress_view.ProgressView.on_state

    def on_state(self, state) -> None:
        states.setdefault(str(state), (time.thread_time(), time.monotonic()))
        if str(state) == "running":
            synced.update(k for k in sim.counts.elements() if k.startswith("sync:"))
        entered(self, state)

    progress_view.ProgressView.on_state = on_state
    console = ConsoleCount()
    log = logging.getLogger("megaray")
    log.addHandler(console)
    log.setLevel(logging.INFO)
    if args.show:
        log.addHandler(logging.StreamHandler())

    work = tempfile.mkdtemp(prefix="megaray-scale-sim-")
    script = Path(work, "train.py")
    script.write_text("print('simulated')\n")
    argv = ["--nodes", str(nodes), "--gpus-per-node", str(args.per_node), "--runs-dir", work,
            "--job-name", "sim", "--kill-grace", "2", str(script)]  # fmt: skip
    spec = spec_from_args(argv, environ={}, cwd=work)

    lost_at: list[float] = []
    if args.fail == "node":  # halfway through the run: a node's raylet stops answering
        lost = sorted(sim.nodes)[nodes // 2]

        def lose() -> None:
            while "running" not in states:
                time.sleep(0.1)
            time.sleep(args.run_s / 2)
            lost_at.append(time.monotonic())
            sim.lose_node(lost)

        import threading

        threading.Thread(target=lose, daemon=True).start()

    cpu0, t0 = time.thread_time(), time.monotonic()
    error: BaseException | None = None
    result = None
    samples: Counter[str] = Counter()
    if os.environ.get("SCALE_SIM_PROFILE"):  # where the driver's main thread is, sampled every 5 ms
        import threading

        main_id = threading.get_ident()

        def sample() -> None:
            while True:
                time.sleep(0.005)
                frame = sys._current_frames().get(main_id)
                where = []
                while frame is not None and len(where) < 3:
                    code = frame.f_code
                    if "launcher" in code.co_filename or not where:
                        where.append(f"{Path(code.co_filename).name}:{code.co_name}")
                    frame = frame.f_back
                samples[" < ".join(where)] += 1

        threading.Thread(target=sample, daemon=True).start()
    try:
        result = launch(spec)
    except MegarayError as e:
        error = e
    for where, n in samples.most_common(25):
        print(f"{n:6d} {where}", file=sys.stderr)
    wall = time.monotonic() - t0
    cpu = time.thread_time() - cpu0
    # as the command prints it (cli/main.py): a rank failure's whole report, else the one line
    shown_error = error.report() if hasattr(error, "report") else str(error)
    report_lines = shown_error.count("\n") + 1 if error is not None else 0
    sync = {k.split(":", 1)[1]: v for k, v in sim.counts.items() if k.startswith("sync:")}
    timings = result.timings if result is not None else {}
    running = states.get("running", (cpu0 + cpu, t0 + wall))
    after = [at for state, at in states.items() if at[1] > running[1]]
    ended = after[0] if after else (cpu0 + cpu, t0 + wall)
    launch_cpu = running[0] - cpu0
    watch_cpu, watch_s = ended[0] - running[0], max(1e-9, ended[1] - running[1])
    end_cpu = cpu0 + cpu - ended[0]
    out = {
        "ranks": args.ranks,
        "nodes": nodes,
        "outcome": "ok" if error is None else type(error).__name__,
        "wall_s": round(wall, 2),
        "placed_s": timings.get("placed", "-"),
        "actors_ready_s": timings.get("actors_ready", "-"),
        "running_s": timings.get("env_set", "-"),
        "driver_cpu_ms_per_rank": round((launch_cpu + end_cpu) * 1000 / args.ranks, 3),
        "launch_cpu_ms_per_rank": round(launch_cpu * 1000 / args.ranks, 3),
        "end_cpu_ms_per_rank": round(end_cpu * 1000 / args.ranks, 3),
        "watch_cpu_share": round(watch_cpu / watch_s, 3),  # of one core, while the ranks run
        "launch_sync_rpcs_per_node": round(sum(synced.values()) / nodes, 2),
        "end_sync_rpcs_per_node": round((sum(sync.values()) - sum(synced.values())) / nodes, 2),
        "max_console_lag_s": round(max(lags), 3) if lags else "-",
        "p50_console_lag_s": round(sorted(lags)[len(lags) // 2], 3) if lags else "-",
        "console_lags_over_1s": f"{sum(lag > 1 for lag in lags)}/{len(lags)}",
        "console_lines": console.lines,
        "failure_report_lines": report_lines,
        "node_lost_to_stop_s": round(ended[1] - lost_at[0], 2) if lost_at else "-",
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        # how late the simulation's own event loop ran (the ranks and forwarders): its load, not megaray's
        "sim_loop_lag_p50_s": round(sorted(sim.loop_lags)[len(sim.loop_lags) // 2], 3)
        if sim.loop_lags
        else "-",
    }
    print("sync GCS calls: " + ", ".join(f"{k} {v}" for k, v in sorted(sync.items())), file=sys.stderr)
    if error is not None:
        print(f"the failure as the console shows it ({report_lines} lines):\n{shown_error}", file=sys.stderr)
    print(" ".join(f"{k}={v}" for k, v in out.items()))
    sys.stdout.flush()
    os._exit(0)  # the simulated cluster's threads are not joined


if __name__ == "__main__":
    sys.exit(main())
