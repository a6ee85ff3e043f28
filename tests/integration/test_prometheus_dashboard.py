"""Integration: every Grafana panel's query, evaluated by a real Prometheus scraping a running fleet.

Debian's ``prometheus`` binary (``make test`` installs the package where apt is there; the test
skips with a message where the binary is absent) runs with a config of its own in a temp
directory, on 127.0.0.1 and a free port, scraping the broker's exporter every second. The fleet
is ``test_metrics_scrape``'s (mlp and two ``profiled`` emulations on real Ray Serve on CPU) plus a
tiny LLM where its engine can run here, so the engine panels have series too (else they are skipped,
named). After traffic to every model and two more
scrapes, each panel's PromQL (``configs/grafana/gpubroker.json``, Grafana's variables
substituted) goes through ``/api/v1/query`` and must return at least one series.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import subprocess
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
if not Path(PROMETHEUS).is_file():
    pytest.skip(
        f"no Prometheus binary ({PROMETHEUS}): install Debian's package (apt-get install prometheus; "
        "`make test` does where apt-get is there and it runs as root) to evaluate the dashboard's queries",
        allow_module_level=True,
    )
httpx = pytest.importorskip("httpx")

from gpubroker.deployments.cluster.local_ray import free_port  # noqa: E402
from tests.integration.test_metrics_scrape import CONFIG, running_fleet, traffic  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "gpubroker.json"
LLM = """
  chat:
    kind: llm
    model: tiny-llama
    options: {{max_model_len: 128, kv_cache_blocks: 32, kv_cache_blocks_max: 128, max_num_seqs: 2, max_num_seqs_max: 16}}
    llm: {{expected_peak_concurrency: 12, ttft_slo_ms: 5000, tpot_slo_ms: 1000}}
    quota: {{min: 64MiB, base: 192MiB, max: 384MiB}}
"""


def no_llm_engine() -> str | None:
    """Why the tiny LLM cannot serve in this environment (its panels are then skipped), or None."""
    try:
        from gpubroker.deployments.llm import server
    except ImportError as exc:
        return f"the LLM server does not import here ({exc})"
    if hasattr(server, "VllmEngine") and find_spec("vllm") is None:
        return "the LLM engine is vLLM and vllm is not installed in this environment"
    if find_spec("transformers") is None:
        return "transformers (the tiny LLM's weights) is not installed"
    return None


NO_LLM = no_llm_engine()
SCRAPE_INTERVAL_S = 1
RATE_INTERVAL = "1m"  # Grafana's $__rate_interval: many scrapes wide


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    config = CONFIG if NO_LLM else CONFIG.replace("\nmodels:\n", "\nmodels:\n" + LLM.lstrip("\n"), 1)
    with running_fleet(config, tmp_path_factory.mktemp("broker")) as f:
        yield f


@pytest.fixture(scope="module")
def prometheus(fleet, tmp_path_factory):
    """A Prometheus of its own scraping the fleet's exporter; yields its base URL."""
    work = tmp_path_factory.mktemp("prometheus")
    target = fleet["metrics_url"].removeprefix("http://").removesuffix("/metrics")
    (work / "prometheus.yml").write_text(
        f"global: {{scrape_interval: {SCRAPE_INTERVAL_S}s, evaluation_interval: {SCRAPE_INTERVAL_S}s}}\n"
        f"scrape_configs:\n  - job_name: gpubroker\n    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(url, proc, work), timeout_s=60, interval_s=0.5, what="Prometheus ready")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _ready(url: str, proc: subprocess.Popen, work: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"prometheus exited {proc.returncode}: {(work / 'prometheus.log').read_text()[-2000:]}")
    try:
        return httpx.get(f"{url}/-/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def query(prom: str, expr: str) -> list[dict]:
    """The instant vector ``expr`` evaluates to now (``/api/v1/query``); an error names the query."""
    body = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert body.get("status") == "success", f"{expr}: {body}"
    return body["data"]["result"]


def scrapes(prom: str) -> int:
    """Successful scrapes of the broker in the last 10 minutes."""
    result = query(prom, 'sum_over_time(up{job="gpubroker"}[10m])')
    return int(float(result[0]["value"][1])) if result else 0


def grafana(expr: str) -> str:
    """A panel's query as Grafana sends it with every model and card selected."""
    for var, value in (("$__rate_interval", RATE_INTERVAL), ("$__interval", f"{SCRAPE_INTERVAL_S}s")):
        expr = expr.replace(var, value)
    return expr.replace('=~"$model"', '=~".*"').replace('=~"$gpu"', '=~".*"')


def llm_traffic(base_url: str, n: int = 6) -> int:
    def one(i: int) -> int:
        body = {"model": "chat", "prompt": f"hello {i}", "max_tokens": 8}
        return httpx.post(f"{base_url}/openai/v1/completions", json=body, timeout=120).status_code

    with cf.ThreadPoolExecutor(3) as pool:
        return sum(code == 200 for code in pool.map(one, range(n)))


@pytest.fixture(scope="module")
def loaded(fleet, prometheus) -> str:
    """Traffic to every model (the LLM too), then two scrapes after it: its reports are in rate() windows."""
    wait_for(lambda: scrapes(prometheus) >= 2, timeout_s=60, interval_s=0.5, what="two scrapes of the broker")
    if not NO_LLM:
        assert llm_traffic(fleet["base_url"]) >= 1
    assert traffic(fleet, seconds=4.0, workers=6) > 10
    after = scrapes(prometheus)
    wait_for(lambda: scrapes(prometheus) >= after + 2, timeout_s=60, interval_s=0.5, what="two scrapes after traffic")
    return prometheus


def panel_queries(llm: bool) -> list[tuple[str, str]]:
    """(panel title and refId, query as Grafana sends it) of the LLM panels or of the others."""
    dash = json.loads(DASHBOARD.read_text())
    return [
        (f"panel {panel['title']!r} {target['refId']}", grafana(target["expr"]))
        for panel in dash["panels"]
        if any("gpubroker_llm_" in t["expr"] for t in panel["targets"]) == llm
        for target in panel["targets"]
    ]


def test_every_dashboard_panel_query_returns_series(loaded):
    queries = panel_queries(llm=False)
    empty = [f"{where}: {expr}" for where, expr in queries if not query(loaded, expr)]
    assert len(queries) >= 20 and empty == [], "queries with no series:\n" + "\n".join(empty)
    for ann in json.loads(DASHBOARD.read_text())["annotations"]["list"]:  # valid PromQL, empty while nothing changes
        if "expr" in ann:
            query(loaded, grafana(ann["expr"]))


@pytest.mark.skipif(NO_LLM is not None, reason=f"LLM panels not evaluated: {NO_LLM}")
def test_every_llm_panel_query_returns_series(loaded):
    queries = panel_queries(llm=True)
    empty = [f"{where}: {expr}" for where, expr in queries if not query(loaded, expr)]
    assert len(queries) >= 10 and empty == [], "queries with no series:\n" + "\n".join(empty)


def test_panels_read_what_the_broker_reports(fleet, loaded):
    """Beyond "some series": one series per model where a panel shows models, the dashboard's
    $model variable lists every model, and the latency histogram's P95 of a model that served is a number."""
    models = set(fleet["cfg"].models)
    granted = query(loaded, "sum by (model) (gpubroker_quota_granted_bytes)")
    assert {s["metric"]["model"] for s in granted} == models
    dash = json.loads(DASHBOARD.read_text())
    variable = next(v for v in dash["templating"]["list"] if v["name"] == "model")
    selector = variable["query"]["query"].removeprefix("label_values(").rsplit(",", 1)[0]
    values = httpx.get(f"{loaded}/api/v1/label/model/values", params={"match[]": grafana(selector)}, timeout=30)
    assert set(values.json()["data"]) == models
    outcomes = {
        (s["metric"]["model"], s["metric"]["outcome"]): float(s["value"][1])
        for s in query(loaded, "sum by (model, outcome) (gpubroker_requests_total)")
    }
    served = {model for (model, outcome), n in outcomes.items() if outcome == "ok" and n > 0}
    assert {"mlp", "hot"} <= served, outcomes
    p95 = query(
        loaded, "histogram_quantile(0.95, sum by (le, model) (rate(gpubroker_request_latency_seconds_bucket[5m])))"
    )
    by_model = {s["metric"]["model"]: float(s["value"][1]) for s in p95}
    assert all(0 < by_model.get(model, -1) < 60 for model in served - {"chat"}), (by_model, outcomes)
