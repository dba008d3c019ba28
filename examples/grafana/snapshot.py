"""A picture of megaray's Grafana dashboard (megaray.json, beside this file) for one job, drawn from a
Prometheus's data with matplotlib: for where no Grafana is at hand (a bug report, the docs' picture,
a machine without a browser). Each panel sits where the dashboard puts it and runs its own queries,
with the job filled in as Grafana fills its variable; a panel with no data says so.

    python examples/grafana/snapshot.py --prometheus http://localhost:9090 --job my-job --out run.png

It prints the panels that had no data (a CPU run has no GPU memory), and exits 0 either way.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "megaray.json"
GRID_W = 24  # Grafana's grid columns
UNIT_W_IN, UNIT_H_IN = 0.75, 0.36  # inches of one grid cell in the picture
TOP_ROWS = 2  # grid rows above the dashboard's, for the picture's title


@dataclass(frozen=True)
class Series:
    label: str
    times: list[float]
    values: list[float]


def promql(expr: str, job: str) -> str:
    """The query Grafana sends for `job`: `$megaray_job` filled in, escaped as a regular expression
    (its matchers are `=~`) inside a PromQL string (whose backslashes are doubled)."""
    return expr.replace("$megaray_job", re.escape(job).replace("\\", "\\\\"))


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's `{{label}}` legend format."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    args = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query_range?{args}", timeout=30) as answer:
            body = json.loads(answer.read())
    except urllib.error.HTTPError as e:  # Prometheus says why in its body
        raise RuntimeError(f"{expr}: {e.read().decode(errors='replace')}") from None
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def panel_series(url: str, panel: dict, job: str, start: float, end: float, step: float) -> list[Series]:
    out = []
    for target in panel.get("targets", []):
        for result in query_range(url, promql(target["expr"], job), start, end, step):
            points = [(float(t), float(v)) for t, v in result["values"]]
            label = legend(target.get("legendFormat", ""), result["metric"]) or target["expr"]
            out.append(Series(label, [t - start for t, _ in points], [v for _, v in points]))
    return out


def shown(value: float, unit: str | None) -> str:
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "bytes":
        return f"{value / 2**30:.1f} GiB"
    if unit == "s":
        return f"{value:.1f} s"
    return f"{value:.4g}"


def draw_stat(ax, panel: dict, series: list[Series]) -> None:
    """The value at the window's end of each series that has one (a query filtered with `== 1`
    leaves a state's series only where it held); a state panel shows the names of those at 1."""
    ax.axis("off")
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    latest = max(s.times[-1] for s in series)
    series = [s for s in series if s.times[-1] == latest]
    if "state" in panel["targets"][0]["legendFormat"]:
        lines = [s.label.split(": ")[-1] for s in series if s.values and s.values[-1] == 1]
    else:
        lines = [f"{s.label}: {shown(s.values[-1], unit)}" for s in series if s.values]
    size = 20 if len(lines) == 1 else 12
    ax.text(0.5, 0.45, "\n".join(lines[:6]), ha="center", va="center", fontsize=size, weight="bold",
            color="#2f7d32", transform=ax.transAxes)  # fmt: skip


def draw_timeseries(ax, panel: dict, series: list[Series]) -> None:
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    for s in series[:10]:
        values = [v * 100 for v in s.values] if unit == "percentunit" else s.values
        ax.plot(s.times, values, label=s.label, linewidth=1.2)
    ax.set_xlabel("seconds", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if unit in ("s", "percentunit", "bytes"):
        ax.set_ylabel({"s": "s", "percentunit": "%", "bytes": "bytes"}[unit], fontsize=7)
    ax.legend(fontsize=6, loc="best")


def draw_heatmap(ax, panel: dict, series: list[Series]) -> None:
    """One row per series (a rank), its value over time as colour."""
    rows = sorted(series, key=lambda s: int(s.label) if s.label.isdigit() else s.label)
    times = sorted({t for s in rows for t in s.times})
    at = {t: i for i, t in enumerate(times)}
    grid = [[float("nan")] * len(times) for _ in rows]
    for row, s in zip(grid, rows, strict=True):
        for t, v in zip(s.times, s.values, strict=True):
            row[at[t]] = v
    extent = (times[0], times[-1], len(rows) - 0.5, -0.5)
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", extent=extent, cmap="viridis")
    ax.set_yticks(range(len(rows)), [f"rank {s.label}" for s in rows], fontsize=7)
    ax.set_xlabel("seconds", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.figure.colorbar(image, ax=ax, pad=0.01).ax.tick_params(labelsize=7)


DRAW = {"stat": draw_stat, "timeseries": draw_timeseries, "heatmap": draw_heatmap}


def snapshot(url: str, job: str, start: float, end: float, out: Path, board: dict | None = None) -> list[str]:
    """The dashboard for `job` over [start, end] (Unix seconds) into `out`; the titles of the panels
    that had no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = board or json.loads(DASHBOARD.read_text())
    panels = board["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) + TOP_ROWS
    width, height = GRID_W * UNIT_W_IN, rows * UNIT_H_IN
    fig = plt.figure(figsize=(width, height))

    def box(g: dict, left: float, bottom: float, top: float) -> tuple[float, float, float, float]:
        """A grid place as figure fractions, less room (inches) for tick labels and the title."""
        x0, y0 = g["x"] * UNIT_W_IN + left, height - (g["y"] + g["h"] + TOP_ROWS) * UNIT_H_IN + bottom
        w, h = g["w"] * UNIT_W_IN - left - 0.15, g["h"] * UNIT_H_IN - bottom - top
        return x0 / width, y0 / height, w / width, h / height

    step = max(1.0, (end - start) / 300)
    empty = []
    for panel in panels:
        g = panel["gridPos"]
        if panel["type"] == "row":
            x0, y0, _, h = box(g, 0.05, 0.0, 0.0)
            fig.text(x0, y0 + h / 2, panel["title"], fontsize=13, weight="bold", va="center")
            continue
        stat = panel["type"] == "stat"
        ax = fig.add_axes(box(g, 0.1 if stat else 0.75, 0.1 if stat else 0.5, 0.3))
        ax.set_title(panel["title"], fontsize=9, loc="left")
        series = [s for s in panel_series(url, panel, job, start, end, step) if s.values]
        if not series:
            empty.append(panel["title"])
            ax.axis("off")
            ax.text(0.5, 0.5, "no data", ha="center", va="center", color="grey", transform=ax.transAxes)
            continue
        DRAW.get(panel["type"], draw_timeseries)(ax, panel, series)
    fig.text(0.005, 1 - 0.5 * UNIT_H_IN / height, f"{board['title']}: job {job}", fontsize=15, va="top")
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return empty


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prometheus", default="http://localhost:9090", help="the Prometheus to query")
    ap.add_argument("--job", required=True, help="the megaray job (its --job-name)")
    ap.add_argument("--minutes", type=float, default=30, help="the window, ending now (default 30)")
    ap.add_argument("--end", type=float, help="the window's end, Unix seconds (default now)")
    ap.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = ap.parse_args(argv)
    end = args.end or time.time()
    empty = snapshot(args.prometheus.rstrip("/"), args.job, end - args.minutes * 60, end, args.out)
    print(f"wrote {args.out}" + (f"; no data for: {', '.join(empty)}" if empty else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
