"""Job health where operators look: while a job runs on a real two-node `ray start` cluster, a real
Prometheus (Debian's package) scraping the targets Ray lists in its service-discovery file holds
megaray's series for every rank and the job's state, and every query of the Grafana dashboard in
examples/grafana/ returns data (so the dashboard cannot drift from the names)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import drive, prometheus
from .raycluster import start_cluster

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "examples" / "grafana" / "megaray.json"
JOB = "mx-health"
CUDA_ONLY = "gpu_memory"  # a CPU rank has no GPU memory to report
EXPORT_S = 2  # Ray's metrics export interval on the test's cluster; it drops a gauge after two

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
        "Where did the time go?",
    ]  # fmt: skip
    assert all(t["expr"].count("ray_megaray_") for p in panels for t in p["targets"])


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """A two-node `ray start` cluster, and a Prometheus scraping the targets Ray lists for it.
    Ray exports every EXPORT_S instead of its default 10 s, which an operator may set too: what
    the tests wait for comes sooner, and what they check (a value kept for intervals where nothing
    set it) is checked over as many intervals."""
    cluster = start_cluster(num_cpus=2, RAY_metrics_report_interval_ms=str(EXPORT_S * 1000))
    prom = None
    try:
        cluster.add_worker(num_cpus=2)
        sd_file = cluster.tmp / "session_latest" / "prom_metrics_service_discovery.json"
        prom = prometheus.Prometheus(sd_file, tmp_path_factory.mktemp("prometheus"))
        yield cluster, prom
    finally:
        if prom is not None:
            prom.stop()
        cluster.stop()


def start_job(cluster, tmp_path: Path, job: str, *args: str) -> tuple[subprocess.Popen, Path]:
    env = drive.user_env(cluster.env, drop=("RAY_AUTH_MODE",))
    log = tmp_path / "driver.log"
    args = ("--address", cluster.gcs, "--device", "cpu", "--nodes", "2", "--gpus-per-node", "2",
            "--job-name", job, "--runs-dir", str(tmp_path / "runs"), *args)  # fmt: skip
    return drive.start(*args, env=env, log=log), log


def wait_for(prom, driver: subprocess.Popen, log: Path, missing_now, within_s: float = 120) -> None:
    """Until `missing_now()` finds nothing missing (the job still running)."""
    missing: list[str] = ["(not looked yet)"]
    deadline = time.monotonic() + within_s
    while missing and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.5)
        missing = missing_now()
    have = sorted({r["metric"]["__name__"] for r in prom.query('{__name__=~"ray_megaray_.+"}')})
    assert not missing, f"no data for {missing}; series there: {have}\n" + log.read_text()[-3000:]


REPORTS = """
import time, launcher
for it in range(1, 3000):
    launcher.report(it, total=3000, loss=1.0, tokens=8192)
    time.sleep(0.2)
"""


def ranks_of(prom, query: str) -> set[str | None]:
    return {r["metric"].get("rank") for r in prom.query(query)}


def test_a_real_prometheus_holds_every_ranks_metrics_and_the_job_state_and_every_dashboard_query_has_data(
    scraped, tmp_path
):
    cluster, prom = scraped
    stop = tmp_path / "stop"
    driver, log = start_job(
        cluster, tmp_path, JOB, "--max-restarts", "1", "tests/fixtures/metrics_job.py", str(stop)
    )
    try:
        queries = {k: as_promql(v) for k, v in dashboard_queries().items() if CUDA_ONLY not in v}
        per_rank = [
            f'ray_megaray_rank_{m}{{megaray_job="{JOB}"}}'
            for m in ("step_seconds", "tokens_per_second", "loss")
        ]
        running = f'ray_megaray_job_state{{megaray_job="{JOB}",state="running"}} == 1'

        def missing_now() -> list[str]:
            # every rank of the relaunch, by its rank label
            out = [q for q in per_rank if ranks_of(prom, q) != {"0", "1", "2", "3"}]
            out += [] if prom.query(running) else [running]
            return out + [f"{k}: {q}" for k, q in queries.items() if not prom.query(q)]

        wait_for(prom, driver, log, missing_now)
        # the first attempt's rank 3 exited with 3: one failure of kind `exit`, one relaunch
        failures = prom.query(f'ray_megaray_job_failures_total{{megaray_job="{JOB}"}}')
        assert [(r["metric"]["kind"], r["value"][1]) for r in failures] == [("exit", "1")]
        restarts = prom.query(f'ray_megaray_job_restarts_total{{megaray_job="{JOB}"}}')
        assert [(r["metric"]["kind"], r["value"][1]) for r in restarts] == [("failure", "1")]
        world = prom.query(f'ray_megaray_job_world_size{{megaray_job="{JOB}"}}')
        assert [r["value"][1] for r in world] == ["4"]
        # where the time went so far (#47): the relaunch, and training on both sides of it
        goodput = prom.query(f'ray_megaray_job_goodput_seconds{{megaray_job="{JOB}"}}')
        spent = {r["metric"]["cause"]: float(r["value"][1]) for r in goodput}
        causes = ["checkpoint", "idle", "recomputed", "restarts", "start-up", "straggler", "training"]
        assert sorted(spent) == causes, spent
        assert spent["restarts"] > 0 and spent["training"] > 0 and spent["start-up"] > 0, spent
        steps = prom.query(per_rank[0])
        assert all(0.15 < float(r["value"][1]) < 2.0 for r in steps), steps  # it reports every 0.2 s
        # the state did not change since, yet stays: Ray drops a gauge value not set for two of its
        # export intervals, megaray sets it again; and rank 2, silent since 8 s into the relaunch,
        # keeps its last progress, so that an operator sees how long ago that was
        # (over the last 3 export intervals: a scrape that timed out on a loaded machine, after 1 s
        # here, marks every series of its target stale at once, and three in a row did so once in a CI
        # run; a value Ray dropped stays gone, and the loop lasts longer than the window)
        seen = time.monotonic()
        window = f"[{3 * EXPORT_S}s]"
        kept = f'last_over_time(ray_megaray_job_state{{megaray_job="{JOB}",state="running"}}{window}) == 1'
        last = f'ray_megaray_rank_last_progress_timestamp_seconds{{megaray_job="{JOB}"}}'
        since = f"time() - last_over_time({last}{window})"
        ages: dict[str, float] = {}
        # a value not set again would be dropped by seen + 3 export intervals, out of the window 3 later
        while time.monotonic() - seen < 7 * EXPORT_S or ages.get("2", 0) < 12:
            assert time.monotonic() - seen < 60, ages
            time.sleep(1)
            went = f"the job's state went {time.monotonic() - seen:.0f} s after it was seen"
            assert prom.query(kept), went
            ages = {r["metric"]["rank"]: float(r["value"][1]) for r in prom.query(since)}
        assert sorted(ages) == ["0", "1", "2", "3"] and ages["2"] > 12 > 3 * EXPORT_S > max(
            ages["0"], ages["1"], ages["3"]
        ), ages
        # the dashboard drawn without Grafana, as a user would (examples/grafana/snapshot.py): every
        # panel had data but the one a CPU run cannot have
        picture = tmp_path / "dashboard.png"
        shot = [sys.executable, str(REPO / "examples" / "grafana" / "snapshot.py"), "--prometheus", prom.url,
                "--job", JOB, "--minutes", "5", "--out", str(picture)]  # fmt: skip
        drawn = subprocess.run(shot, capture_output=True, text=True, timeout=120)
        assert drawn.returncode == 0, drawn.stderr
        assert drawn.stdout.strip() == f"wrote {picture}; no data for: GPU memory by node (needs CUDA)"
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        stop.write_text("")
        assert driver.wait(120) == 0, log.read_text()[-3000:]
        assert cluster.alive(JOB) == ([], [])
    finally:
        if driver.poll() is None:
            driver.kill()


def test_the_megatron_dry_run_exports_each_ranks_forward_step_with_its_tp_pp_dp_and_per_node_on_request(
    scraped, tmp_path
):
    """The tiny Megatron trainer (TP 2 x PP 2 on 4 ranks): megaray times every rank's forward step;
    the job's loss comes from Megatron's own iteration line. Then `--metrics node`: one series a node."""
    cluster, prom = scraped
    job = "mx-dry"
    driver, log = start_job(cluster, tmp_path, job, "--dry-run", "steps=100000")
    try:
        step = f'ray_megaray_rank_step_seconds{{megaray_job="{job}"}}'
        loss = f'ray_megaray_job_loss{{megaray_job="{job}"}}'
        wait_for(
            prom,
            driver,
            log,
            lambda: (
                [q for q in (step, loss) if not prom.query(q)]
                + ([] if ranks_of(prom, step) == {"0", "1", "2", "3"} else ["every rank's step"])
            ),
        )
        coords = {
            r["metric"]["rank"]: (r["metric"]["tp"], r["metric"]["pp"], r["metric"]["dp"])
            for r in prom.query(step)
        }
        assert coords == {
            "0": ("0", "0", "0"),
            "1": ("1", "0", "0"),
            "2": ("0", "1", "0"),
            "3": ("1", "1", "0"),
        }
        driver.send_signal(signal.SIGINT)  # Ctrl-C
        assert driver.wait(60) == 130, log.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    assert cluster.alive(job) == ([], [])

    # --metrics node: a plain program that reports its steps (what --metrics node adds up per node does
    # not depend on where the step times come from; a second Megatron run would only cost imports)
    job, reporter = "mx-node", tmp_path / "reports.py"
    reporter.write_text(REPORTS)
    driver, log = start_job(cluster, tmp_path, job, "--metrics", "node", str(reporter))
    try:
        step = f'ray_megaray_rank_step_seconds{{megaray_job="{job}"}}'
        wait_for(prom, driver, log, lambda: [] if prom.query(step) else [step])
        time.sleep(3)  # both nodes' forwarders
        series = prom.query(step)
        assert [r["metric"].get("rank") for r in series] == [None] * len(series)  # no rank label
        assert 1 <= len(series) <= 2  # one a node (both nodes of this cluster have one address)
        driver.send_signal(signal.SIGINT)
        assert driver.wait(60) == 130, log.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
