"""Integration: the broker's Prometheus endpoint during a real Ray Serve run on CPU.

One Ray instance for the module: a three-model fleet (mlp + two ``profiled`` emulations, one of
them with ``shed_late``: EMULATION, it sleeps a + c*b ms; there is no GPU here) with the
exporter on a free port, some traffic, then ``/metrics`` is scraped over HTTP, parsed with
``prometheus_client.parser`` and checked against the broker's ``status()`` (what
``gpubroker status --json`` prints): grant bytes, max batch, config hash; then an ``apply``
shows up as a new config hash and a successful reload.

The fleet is started with the library functions of ``deployments/cluster/fleet.py``
(``deploy``, ``wait_serving``, ``teardown``), the same ones ``gpubroker up`` uses.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpubroker.deployments.cluster.fleet import deploy, example_inputs, teardown, wait_serving  # noqa: E402
from gpubroker.deployments.cluster.local_ray import free_port  # noqa: E402
from gpubroker.quotas.config import parse_config_text  # noqa: E402

CONFIG = """
broker:
  name: gpubroker-metrics-test
  namespace: gpubroker-metrics-test
  control_interval_s: 0.5
  report_interval_s: 0.25
  metrics_host: 127.0.0.1
  metrics_port: {metrics_port}
  http_host: 127.0.0.1
  http_port: {http_port}
  checkpoint_path: {checkpoint}
gpu:
  device: cpu
  capacity: 2GiB
  reserve_frac: 0.0
  emergency_free_frac: 0.05
models:
  mlp:
    model: mlp
    quota: {{min: 1GiB, base: 1GiB, max: 1GiB}}
    batch: {{floor: 2, ceiling: 64}}
    slo_p95_ms: {mlp_slo}
    control: {{window_s: 5, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}}
  hot:
    model: profiled
    options: {{a_ms: 10, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 4194304}}
    quota: {{min: 64MiB, base: 256MiB, max: 512MiB}}
    batch: {{floor: 2, ceiling: 32, initial: 4}}
    wait: {{min_ms: 0, max_ms: 20}}
    slo_p95_ms: 1500
    control: {{window_s: 4, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}}
  late:
    model: profiled
    options: {{a_ms: 200, c_ms: 0, weights_bytes: 1048576, bytes_per_item: 0}}
    quota: {{min: 32MiB, base: 64MiB, max: 64MiB}}
    batch: {{floor: 1, ceiling: 1, initial: 1}}
    wait: {{min_ms: 0, max_ms: 1}}
    slo_p95_ms: 450
    shed_late: true
"""


@contextmanager
def running_fleet(config: str, workdir: Path) -> Iterator[dict]:
    """``config`` (a template of this module's CONFIG's fields) deployed on a local Ray of its own, the
    exporter on a free port: ``cfg``, ``text(mlp_slo)``, ``broker``, ``base_url``, ``metrics_url``."""
    ports = {"metrics_port": free_port(), "http_port": free_port()}
    ckpt = workdir / "ckpt.json"

    def text(mlp_slo: int = 2000) -> str:
        return config.format(checkpoint=ckpt, mlp_slo=mlp_slo, **ports)

    cfg = parse_config_text(text(), "test")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="gpubroker-metrics-test"
    )
    try:
        broker = deploy(cfg, text(), http_port=ports["http_port"], timeout_s=300)
        base_url = f"http://127.0.0.1:{ports['http_port']}"
        wait_serving(cfg, base_url, timeout_s=300)
        yield {
            "cfg": cfg,
            "text": text,
            "broker": broker,
            "base_url": base_url,
            "metrics_url": f"http://127.0.0.1:{ports['metrics_port']}/metrics",
        }
    finally:
        try:
            teardown(cfg)
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with running_fleet(CONFIG, tmp_path_factory.mktemp("broker")) as f:
        yield f


def traffic(fleet, seconds: float = 4.0, workers: int = 8) -> int:
    """Requests to mlp, hot and late from ``workers`` threads for ``seconds``; how many were answered 200."""
    inputs = example_inputs(fleet["cfg"])
    deadline = time.time() + seconds

    def worker(i: int) -> int:
        name = ("mlp", "hot", "late")[i % 3]
        n = 0
        with httpx.Client(timeout=30.0) as c:
            while time.time() < deadline:
                r = c.post(f"{fleet['base_url']}/v1/models/{name}/infer", json={"input": inputs[name]})
                n += r.status_code == 200
        return n

    with cf.ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(worker, range(workers)))


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """name -> {sorted label items -> value} for every sample of the endpoint."""
    text = httpx.get(url, timeout=10).text
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def sample(m, name: str, **labels) -> float | None:
    return m.get(name, {}).get(tuple(sorted(labels.items())))


def _fields(m, models) -> dict:
    return {
        n: (
            sample(m, "gpubroker_quota_granted_bytes", model=n, gpu="cpu"),
            sample(m, "gpubroker_max_batch_requests", model=n, gpu="cpu"),
        )
        for n in models
    }


def consistent_view(fleet, tries: int = 20):
    """A (scrape, status) pair with no tick between them: scrape, status, scrape until both scrapes agree."""
    broker = fleet["broker"]
    models = list(fleet["cfg"].models)
    for _ in range(tries):
        before = scrape(fleet["metrics_url"])
        st = ray.get(broker.status.remote(), timeout=30)
        after = scrape(fleet["metrics_url"])
        if _fields(before, models) == _fields(after, models) and sample(
            before, "gpubroker_ticks_total", gpu="cpu"
        ) == sample(after, "gpubroker_ticks_total", gpu="cpu"):
            return after, st
        time.sleep(0.1)
    raise AssertionError("the broker ticked between every scrape pair")


def test_a_late_request_is_shed_over_http_and_counted(fleet):
    """``late`` runs batches of one that take 200 ms under a 450 ms SLO with shed_late: of 10
    requests at once, the first two can still make it (200, 400 ms); the others have waited
    ~400 ms when the second batch ends and get 504 then, through the proxy, counted as shed."""
    url = f"{fleet['base_url']}/v1/models/late/infer"
    item = example_inputs(fleet["cfg"])["late"]
    with httpx.Client(timeout=30.0) as c:
        assert c.post(url, json={"input": item}).status_code == 200  # a batch ran: the replica knows its time

    def one(_i: int) -> tuple[int, dict]:
        with httpx.Client(timeout=30.0) as c:
            r = c.post(url, json={"input": item})
            return r.status_code, r.json()

    t0 = time.time()
    with cf.ThreadPoolExecutor(10) as pool:
        out = list(pool.map(one, range(10)))
    codes = [code for code, _ in out]
    assert set(codes) <= {200, 504}, out  # every request answered: served or shed
    assert codes.count(200) >= 1 and codes.count(504) >= 3, codes
    assert time.time() - t0 < 10 * 0.2  # the shed ones did not wait their turn
    for code, body in out:
        if code == 504:
            assert body["shed"] is True and body["detail"].startswith("shed: waited"), body
    deadline = time.time() + 20
    while time.time() < deadline:  # the replica's next report carries them to the broker's counters
        shed = sample(scrape(fleet["metrics_url"]), "gpubroker_requests_total", model="late", gpu="cpu", outcome="shed")
        if shed is not None and shed >= codes.count(504):
            break
        time.sleep(0.5)
    assert shed == codes.count(504)


def test_scrape_matches_broker_status(fleet):
    served = traffic(fleet)
    assert served > 20
    time.sleep(1.5)  # let reports land and a few ticks pass
    m, st = consistent_view(fleet)
    assert st["metrics_url"] == fleet["metrics_url"]
    assert st["ticks"] >= 3
    for name, ms in st["models"].items():
        assert sample(m, "gpubroker_quota_granted_bytes", model=name, gpu="cpu") == ms["grant_bytes"], name
        assert sample(m, "gpubroker_max_batch_requests", model=name, gpu="cpu") == ms["max_batch_size"], name
        assert sample(m, "gpubroker_quota_base_bytes", model=name, gpu="cpu") == ms["base_bytes"], name
        assert sample(m, "gpubroker_settings_version", model=name, gpu="cpu") == ms["settings_version"], name
        assert sample(m, "gpubroker_batch_wait_timeout_seconds", model=name, gpu="cpu") == pytest.approx(
            ms["batch_wait_timeout_s"]
        )
        assert sample(m, "gpubroker_requests_total", model=name, gpu="cpu", outcome="ok") > 0, name
        assert sample(m, "gpubroker_request_latency_seconds_count", model=name, gpu="cpu") > 0, name
        assert sample(m, "gpubroker_reports_total", model=name, gpu="cpu") > 0, name
        assert sample(m, "gpubroker_arrivals_total", model=name, gpu="cpu") > 0, name
    assert sample(m, "gpubroker_config_info", config_hash=st["config_hash"]) == 1
    assert sample(m, "gpubroker_card_capacity_bytes", gpu="cpu") == st["capacity_bytes"]
    assert sample(m, "gpubroker_card_usable_bytes", gpu="cpu") == st["usable_bytes"]
    assert sample(m, "gpubroker_card_granted_bytes", gpu="cpu") == st["granted_bytes"]
    assert sample(m, "gpubroker_active_profile", gpu="cpu", profile=st["profile"]) == 1
    assert sample(m, "gpubroker_ticks_total", gpu="cpu") == st["ticks"]
    assert sample(m, "gpubroker_tick_duration_seconds_count", gpu="cpu") == st["ticks"]
    # every series is labelled by config-defined names only
    models = set(st["models"])
    for name, series in m.items():
        for labels in series:
            d = dict(labels)
            assert d.get("model", next(iter(models))) in models, (name, labels)


def test_apply_shows_as_new_config_hash_and_reload(fleet):
    broker = fleet["broker"]
    old = ray.get(broker.status.remote(), timeout=30)["config_hash"]
    result = ray.get(broker.apply.remote(fleet["text"](mlp_slo=2500)), timeout=60)
    assert result["ok"], result
    assert result["config_hash"] != old
    m = scrape(fleet["metrics_url"])
    assert sample(m, "gpubroker_config_info", config_hash=result["config_hash"]) == 1
    assert sample(m, "gpubroker_config_info", config_hash=old) is None
    assert sample(m, "gpubroker_config_last_reload_success") == 1
    refused = ray.get(broker.apply.remote("models: {}\n"), timeout=60)
    assert not refused["ok"]
    m = scrape(fleet["metrics_url"])
    assert sample(m, "gpubroker_config_last_reload_success") == 0
    assert sample(m, "gpubroker_config_reload_failures_total") == 1
    assert sample(m, "gpubroker_config_info", config_hash=result["config_hash"]) == 1  # the running config stays


def test_live_views_against_the_running_broker(fleet):
    import io

    from rich.console import Console

    from gpubroker.cli.live import follow_decisions, watch_status

    broker = fleet["broker"]
    console = Console(record=True, width=220, file=io.StringIO(), color_system=None)
    assert (
        watch_status(lambda: ray.get(broker.status.remote(), timeout=30), interval_s=0.1, console=console, iterations=2)
        == 2
    )
    text = console.export_text()
    assert "mlp" in text and "hot" in text and ray.get(broker.status.remote())["config_hash"] in text
    seen = []
    last = follow_decisions(
        lambda s: ray.get(broker.decisions.remote(None, s), timeout=30),
        seen.append,
        since_seq=0,
        interval_s=0.2,
        iterations=3,
    )
    assert seen and [d["seq"] for d in seen] == sorted({d["seq"] for d in seen}) and last == seen[-1]["seq"]
