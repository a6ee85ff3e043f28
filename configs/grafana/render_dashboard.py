"""Render the Grafana dashboard's panels with matplotlib from a real run (docs/dashboard.png).

Grafana is not installable on the build machine, so this draws the same panels: it starts a
local Ray, a three-model CPU fleet with the exporter on, a Prometheus (``prometheus`` on PATH)
scraping it every second, drives a load with a burst, then runs the dashboard's own PromQL
(``configs/grafana/gpubroker.json``, variables substituted) through Prometheus's query_range
API and plots the results. It is a rendering of the dashboard's queries, not a Grafana
screenshot.

    .venv/bin/python configs/grafana/render_dashboard.py --out docs/dashboard.png   # ~2.5 min
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "gpubroker.json"

FLEET = """
broker:
  name: gpubroker-render
  namespace: gpubroker-render
  control_interval_s: 1.0
  report_interval_s: 0.5
  metrics_port: {metrics_port}
  http_port: {http_port}
  checkpoint_path: {checkpoint}
gpu: {{device: cpu, capacity: 1536MiB, reserve_frac: 0.0, emergency_free_frac: 0.05}}
profiles:
  schedule:
    - {{name: offpeak, default: true, price_per_gpu_hour: 1.20, objective: latency, latency_slack: 1.0}}
models:
  mlp:
    model: mlp
    quota: {{min: 1GiB, base: 1GiB, max: 1GiB}}
    batch: {{floor: 2, ceiling: 64}}
    slo_p95_ms: 300
  hot:
    model: profiled
    options: {{a_ms: 20, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 4194304}}
    quota: {{min: 64MiB, base: 128MiB, max: 512MiB}}
    batch: {{floor: 2, ceiling: 64, initial: 4}}
    wait: {{min_ms: 0, max_ms: 20}}
    slo_p95_ms: 400
    max_queued: 512
    control: {{window_s: 8, idle_hold_s: 4, reclaim_hold_s: 2}}
  cold:
    model: profiled
    options: {{a_ms: 5, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 1048576}}
    quota: {{min: 64MiB, base: 256MiB, max: 256MiB}}
    batch: {{floor: 2, ceiling: 16}}
    slo_p95_ms: 300
    control: {{window_s: 8, idle_hold_s: 4, reclaim_hold_s: 2}}
"""

# (seconds, {model: concurrent clients}) - a burst on `hot` while `cold` idles, then calm
PHASES = [(25, {"mlp": 2, "hot": 2, "cold": 1}), (45, {"mlp": 2, "hot": 24}), (30, {"mlp": 1, "hot": 1, "cold": 2})]


def _drive(base_url: str, inputs: dict, phases) -> None:
    for seconds, clients in phases:
        deadline = time.time() + seconds
        jobs = [(name, inputs[name]) for name, n in clients.items() for _ in range(n)]

        def worker(job, deadline: float = deadline):
            name, item = job
            with httpx.Client(timeout=30.0) as c:
                while time.time() < deadline:
                    try:
                        c.post(f"{base_url}/v1/models/{name}/infer", json={"input": item})
                    except httpx.HTTPError:
                        time.sleep(0.1)

        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(worker, jobs))


def _subst(expr: str, model: str | None, step_s: int) -> str:
    rate = f"{4 * step_s}s"
    expr = expr.replace("$__rate_interval", rate).replace("$__interval", f"{step_s}s")
    expr = expr.replace('model=~"$model"', f'model=~"{model or ".*"}"').replace('gpu=~"$gpu"', 'gpu=~".*"')
    return expr


def _query(prom: str, expr: str, start: float, end: float, step_s: int) -> list[dict]:
    r = httpx.get(
        f"{prom}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step_s}, timeout=30
    )
    body = r.json()
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def _legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


@dataclass(frozen=True)
class Window:
    """The Prometheus to read and the run's time range, at one step."""

    prom: str
    start: float
    end: float
    step_s: int = 1

    def query(self, expr: str, model: str | None) -> list[dict]:
        """A panel's PromQL with Grafana's variables substituted, over the run."""
        return _query(self.prom, _subst(expr, model, self.step_s), self.start, self.end, self.step_s)


def render(prom: str, start: float, end: float, out: Path, models: list[str], step_s: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    win = Window(prom, start, end, step_s)
    dash = json.loads(DASHBOARD.read_text())
    by_title = {p["title"]: p for p in dash["panels"]}
    marks = _decision_marks(dash, win)
    colors = {m: c for m, c in zip(models, ("tab:blue", "tab:orange", "tab:green", "tab:red"))}
    cards = [("$model: batch cap, P95 and queue", m) for m in models] + [
        ("Quota granted by model vs card", None),
        ("Cost per 1k requests", None),
        ("Requests by outcome", None),
        ("Decisions by trigger", None),
        ("Memory used vs grant", None),
    ]
    fig, axes = plt.subplots(4, 2, figsize=(16, 17))
    for ax, (title, model) in zip(axes.flat, cards):
        right = _plot_panel(ax, by_title[title], model, win)
        for x, m in marks:
            if model is None or m == model:
                ax.axvline(x, color=colors.get(m, "grey"), alpha=0.25, lw=0.8)
        _label_panel(ax, right, by_title[title], model)
    for ax in list(axes.flat)[len(cards) :]:
        ax.axis("off")
    fig.suptitle(
        "gpubroker dashboard: the Grafana panels' PromQL from a real CPU run, drawn with matplotlib "
        "(vertical lines: decision annotations)",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


def _decision_marks(dash: dict, win: Window) -> list[tuple[float, str]]:
    """(seconds into the run, model) where each run of non-zero steps of the decision annotation starts."""
    ann = next(a for a in dash["annotations"]["list"] if a.get("name") == "Broker decisions")
    marks = []
    for series in win.query(ann["expr"], None):
        last = None
        for t, _v in series["values"]:
            t = float(t)
            if last is None or t - last > win.step_s:
                marks.append((t - win.start, series["metric"].get("model", "")))
            last = t
    return marks


def _plot_panel(ax, panel: dict, model: str | None, win: Window):  # noqa: ANN001, ANN202 - matplotlib Axes
    """Every target's series of one panel; a per-model panel draws its P95 on a right axis, which it returns."""
    unit = panel["fieldConfig"]["defaults"].get("unit", "short")
    right = ax.twinx() if model else None
    stacked: list = []
    for t in panel["targets"]:
        for series in win.query(t["expr"], model):
            xs = [float(x) - win.start for x, _ in series["values"]]
            ys = [float(y) for _, y in series["values"]]
            if not any(ys):
                continue  # an all-zero series (e.g. no errors) only clutters the legend
            label = _legend(t["legendFormat"], series["metric"])
            if model and label.startswith("P95"):
                style = "--" if "cap" in label else ("-" if "window" in label else ":")
                right.plot(xs, [y * 1000 for y in ys], style, color="tab:red", label=label, lw=1.4)
                continue
            if unit == "bytes":
                ys = [y / 2**20 for y in ys]
            if panel["title"].startswith("Quota") and t["refId"] == "A":
                stacked.append((xs, ys, label))
                continue
            style = "--" if label in ("usable", "capacity") or label.startswith("base") else "-"
            ax.plot(xs, ys, style, label=label, lw=1.4)
    if stacked:
        n = min(len(s[0]) for s in stacked)
        ax.stackplot(stacked[0][0][:n], *[s[1][:n] for s in stacked], labels=[s[2] for s in stacked], alpha=0.6)
    return right


def _label_panel(ax, right, panel: dict, model: str | None) -> None:  # noqa: ANN001 - matplotlib Axes
    """Title, axis labels, one legend (both axes' lines), grid."""
    unit = panel["fieldConfig"]["defaults"].get("unit", "short")
    title = panel["title"]
    ax.set_title(title.replace("$model", model) if model else title)
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel({"bytes": "MiB", "currencyUSD": "USD", "reqps": "req/s"}.get(unit, ""))
    if right is not None:
        right.set_ylabel("P95 ms")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = right.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    else:
        ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = ap.parse_args()
    if shutil.which("prometheus") is None:
        raise SystemExit("needs `prometheus` on PATH (Debian: apt-get install prometheus)")
    import ray

    from gpubroker.deployments.cluster.fleet import deploy, example_inputs, teardown, wait_serving
    from gpubroker.deployments.cluster.local_ray import free_port
    from gpubroker.quotas.config import parse_config_text

    work = Path(tempfile.mkdtemp(prefix="gpubroker-render-"))
    ports = {"metrics_port": free_port(), "http_port": free_port()}
    text = FLEET.format(checkpoint=work / "ckpt.json", **ports)
    cfg = parse_config_text(text, "render")
    prom_port = free_port()
    (work / "prom.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: gpubroker\n    static_configs:\n      - targets: ['127.0.0.1:{ports['metrics_port']}']\n"
    )
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={work / 'prom.yml'}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(work / "prom.log", "w"),
    )
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        deploy(cfg, text, http_port=ports["http_port"], timeout_s=300)
        base_url = f"http://127.0.0.1:{ports['http_port']}"
        wait_serving(cfg, base_url, timeout_s=300)
        start = time.time()
        driver = threading.Thread(target=_drive, args=(base_url, example_inputs(cfg), PHASES))
        driver.start()
        driver.join()
        time.sleep(3)
        end = time.time()
        render(f"http://127.0.0.1:{prom_port}", start, end, args.out, list(cfg.models))
        print(f"wrote {args.out} ({end - start:.0f}s of data)")
    finally:
        try:
            teardown(cfg)
        finally:
            ray.shutdown()
            prom.terminate()
            prom.wait(timeout=10)
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    main()
