"""What the Prometheus metrics cost (core/metrics.py, rank/metrics.py, driver/output/metrics.py).

- step time: 2 simulated nodes x 2 CPU ranks of a gloo program whose steps compute (a 1-thread
  matmul), all-reduce and call `report()` on every rank (each report is recorded as metrics by the
  rank's node's forwarder), run with `--metrics rank` and `--metrics off`, alternately; rank 0 prints
  its median step time; the ratio of the medians is the cost (the order swapped each repeat).
- CPU: in a Ray actor, a node's recording alone (8 ranks reporting 5 times a second, and the values
  kept alive every second, with Ray's gauges) against the same actor doing nothing, each for
  `--cpu-s` seconds: its process's extra CPU seconds per second (Ray's export thread included). In
  the driver: the job's metrics (states kept alive every second, the progress, every rank's
  straggler score every 2 s) for 8 and for 4,096 ranks, the same way. A rank records nothing: its
  reports go to its forwarder as before.

    python bench/metrics.py --repeats 3
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stragglers
from common import REPO, median, ray_cluster, summary
from stragglers import megaray

# the stragglers bench's program, every rank reporting each step
STEPS = stragglers.STEPS.replace("import torch,", "import launcher\nimport torch,").replace(
    "    times.append(",
    "    launcher.report(i + 1, loss=1 / (i + 1), tokens=8192, lr=3e-4, flops=1e12)\n    times.append(",
)
assert STEPS.count("launcher") == 2, "bench/stragglers.py's program changed"


def step_ms(address: str, script: Path, steps: int, mode: str) -> float:
    out, _ = megaray(address, script, [str(steps)], ["--metrics", mode], per_node=1).communicate(timeout=600)
    found = re.search(r"median step ms ([\d.]+)", out)
    if not found:
        raise RuntimeError(out[-3000:])
    return float(found.group(1))


def node_recorder(seconds: float, ranks: int = 8, reports_per_s: float = 5.0) -> tuple[float, float]:
    """CPU seconds per second of an actor recording a node's ranks' metrics, and of one idle."""
    import ray

    @ray.remote(num_cpus=0)
    class Recorder:
        def run(self, record: bool) -> float:
            from launcher.core.layout import ParallelDims
            from launcher.core.metrics import MetricsMode, rank_labels
            from launcher.rank.metrics import RankMetrics

            where = [("n", "10.0.0.1")] * ranks
            metrics = RankMetrics(
                rank_labels("bench", MetricsMode.RANK, where, ParallelDims(tp=2), 989.0)["n"]
            )
            start_cpu, start = time.process_time(), time.monotonic()
            it, next_keep = 0, start + 1.0
            values = {"loss": 1.0, "tokens": 8192, "lr": 3e-4, "flops": 1e12}
            while (now := time.monotonic()) - start < seconds:
                it += 1
                if record:
                    for rank in range(ranks):
                        metrics.report(rank, {"iteration": it, "time": time.time(), **values})
                    if now >= next_keep:
                        metrics.keep()
                        next_keep = now + 1.0
                time.sleep(1.0 / reports_per_s)
            return (time.process_time() - start_cpu) / (time.monotonic() - start)

    recorder = Recorder.remote()
    ray.get(recorder.run.remote(False))  # the actor's own start, not counted
    on = ray.get(recorder.run.remote(True))
    off = ray.get(recorder.run.remote(False))
    ray.kill(recorder)
    return on, off


def job_recorder(seconds: float, ranks: int) -> tuple[float, float]:
    """CPU seconds per second of this process with the job's metrics of `ranks` ranks recorded and
    kept, and without."""
    from launcher.core.lifecycle import LaunchState
    from launcher.core.metrics import MetricsMode, rank_labels
    from launcher.driver.output.metrics import JobMetrics

    def run(mode: MetricsMode) -> float:
        job = JobMetrics(f"bench-{ranks}-{mode}", mode)
        where = [(f"n{r // 8}", f"10.0.{r // 8 // 250}.{r // 8 % 250}") for r in range(ranks)]
        job.attempt(ranks, ranks // 8, rank_labels(job.job, mode, where, None, 989.0))
        job.on_state(LaunchState.RUNNING)
        start_cpu, start = time.process_time(), time.monotonic()
        it, next_look = 0, start
        while (now := time.monotonic()) - start < seconds:
            it += 1
            job.progress(
                {"iteration": it, "loss": 1.0, "iter_s": 0.5, "tokens_per_s": 1e6, "at": time.time()}
            )
            if now >= next_look:
                job.scores({r: 1.0 for r in range(ranks)})
                next_look = now + 2.0
            time.sleep(0.2)
        out = (time.process_time() - start_cpu) / (time.monotonic() - start)
        job.close()
        return out

    return run(MetricsMode.RANK), run(MetricsMode.OFF)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--cpu-s", type=float, default=20.0, help="seconds each CPU figure is measured over")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="megaray-metrics-"))
    (work / "steps.py").write_text(STEPS)
    sys.path.insert(0, str(REPO))
    on, off = [], []
    with ray_cluster(nodes=2, cpus_per_node=2, gpus_per_node=2) as address:
        for k in range(args.repeats):  # in turn, the order swapped each time: nothing gains by going first
            for mode in ("off", "rank") if k % 2 == 0 else ("rank", "off"):
                (off if mode == "off" else on).append(step_ms(address, work / "steps.py", args.steps, mode))
        import ray

        ray.init(address=address, log_to_driver=False)
        node_on, node_off = node_recorder(args.cpu_s)
        jobs = {ranks: job_recorder(args.cpu_s, ranks) for ranks in (8, 4096)}
        ray.shutdown()
    ratio = median(on) / median(off)
    print(f"step time, ms, every rank reporting every step: metrics on {summary(on)}; off {summary(off)}; "
          f"ratio {ratio:.4f}")  # fmt: skip
    print(f"a node's forwarder, 8 ranks reporting 5/s: {node_on:.4f} CPU s/s recording, {node_off:.4f} idle; "
          f"extra {node_on - node_off:.4f}")  # fmt: skip
    for ranks, (j_on, j_off) in jobs.items():
        print(f"the driver, {ranks} ranks: {j_on:.4f} CPU s/s with the job's metrics, {j_off:.4f} without; "
              f"extra {j_on - j_off:.4f}")  # fmt: skip
    return {"on": on, "off": off, "ratio": ratio, "node": (node_on, node_off), "jobs": jobs}


if __name__ == "__main__":
    main()
