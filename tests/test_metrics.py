"""Job health where operators look: while a job runs on a real two-node `ray start` cluster, a real
Prometheus (Debian's package) scraping the targets Ray lists in its service-discovery file holds
megaray's series for every rank and the job's state, and every query of the Grafana dashboard in
examples/grafana/ returns data (so the dashboard cannot drift from the names)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import prometheus
from .raycluster import start_cluster

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "examples" / "grafana" / "megaray.json"
JOB = "mx-health"
CUDA_ONLY = "gpu_memory"  # a CPU rank has no GPU memory to report

pytestmark = pytest.mark.skipif(not prometheus.available(), reason=prometheus.MISSING)


def dashboard_queries() -> dict[str, str]:
    """Every PromQL expression of the dashboard (its panels' and its variables'), by where it is."""
    board = json.loads(DASHBOARD.read_text())
    out = {f"{p['title']} #{t['refId']}": t["expr"] for p in board["panels"] for t in p.get("targets", [])}
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            out[f"variable {var['name']}"] = var["query"]["query"]
    return out


def as_promql(expr: str) -> str:
    """What Grafana sends for one job: its variables filled in (label_values() is Grafana's own: the
    series it reads from are queried instead)."""
    expr = expr.replace("$megaray_job", JOB)
    if m := re.fullmatch(r"label_values\((.+), (\w+)\)", expr):
        return m.group(1)
    return expr


def test_the_dashboard_is_grafana_json_with_rays_datasource_convention():
    board = json.loads(DASHBOARD.read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert {p["datasource"] for p in panels} == {"${datasource}"}
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == [
        "Is it training?", "How fast?", "Is one rank or node slow?", "Is it failing?",
    ]  # fmt: skip
    assert all(t["expr"].count("ray_megaray_") for p in panels for t in p["targets"])


def test_a_real_prometheus_holds_every_ranks_metrics_and_the_job_state_and_every_dashboard_query_has_data(
    tmp_path,
):
    cluster = start_cluster(num_cpus=2)
    prom = None
    driver = None
    try:
        cluster.add_worker(num_cpus=2)
        sd_file = cluster.tmp / "session_latest" / "prom_metrics_service_discovery.json"
        prom = prometheus.Prometheus(sd_file, tmp_path)
        stop = tmp_path / "stop"
        env = {k: v for k, v in cluster.env.items() if k != "RAY_AUTH_MODE"}
        cmd = [
            sys.executable, "main.py", "--address", cluster.gcs, "--device", "cpu", "--nodes", "2",
            "--gpus-per-node", "2", "--job-name", JOB, "--max-restarts", "1",
            "--runs-dir", str(tmp_path / "runs"), "tests/fixtures/metrics_job.py", str(stop),
        ]  # fmt: skip
        log = tmp_path / "driver.log"
        driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

        queries = {k: as_promql(v) for k, v in dashboard_queries().items() if CUDA_ONLY not in v}
        per_rank = [
            f'ray_megaray_rank_{m}{{megaray_job="{JOB}"}}'
            for m in ("step_seconds", "tokens_per_second", "loss")
        ]
        running = f'ray_megaray_job_state{{megaray_job="{JOB}",state="running"}} == 1'
        missing: list[str] = ["(not looked yet)"]
        deadline = time.monotonic() + 120
        while missing and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(2)
            # every rank of the relaunch, by its rank label, on the node it ran on
            missing = [
                q
                for q in per_rank
                if {r["metric"].get("rank") for r in prom.query(q)} != {"0", "1", "2", "3"}
            ]
            missing += [] if prom.query(running) else [running]
            missing += [f"{k}: {q}" for k, q in queries.items() if not prom.query(q)]
        have = sorted({r["metric"]["__name__"] for r in prom.query('{__name__=~"ray_megaray_.+"}')})
        assert not missing, f"no data for {missing}; series there: {have}\n" + log.read_text()[-3000:]

        # the first attempt's rank 3 exited with 3: one failure of kind `exit`, one relaunch
        failures = prom.query(f'ray_megaray_job_failures_total{{megaray_job="{JOB}"}}')
        assert [(r["metric"]["kind"], r["value"][1]) for r in failures] == [("exit", "1")]
        restarts = prom.query(f'ray_megaray_job_restarts_total{{megaray_job="{JOB}"}}')
        assert [(r["metric"]["kind"], r["value"][1]) for r in restarts] == [("failure", "1")]
        world = prom.query(f'ray_megaray_job_world_size{{megaray_job="{JOB}"}}')
        assert [r["value"][1] for r in world] == ["4"]
        steps = prom.query(per_rank[0])
        assert all(0.15 < float(r["value"][1]) < 2.0 for r in steps), steps  # it reports every 0.2 s
        assert {r["metric"]["node"] for r in steps} <= {
            "127.0.0.1",
            *(r["metric"]["NodeAddress"] for r in steps),
        }

        stop.write_text("")
        assert driver.wait(120) == 0, log.read_text()[-3000:]
        assert cluster.alive(JOB) == ([], [])
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        if prom is not None:
            prom.stop()
        cluster.stop()
