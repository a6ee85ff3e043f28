"""Unit tests: broker/metrics.py (metrics, their Prometheus types, the exporter), gpubroker/cli/live.py (CLI live
views), the Grafana dashboard's queries (tests/integration/test_prometheus_dashboard.py runs them in a real Prometheus)."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from gpubroker.broker.control.types import FleetDecision, ModelDecision, QuotaMove
from gpubroker.broker.metrics import BrokerMetrics, start_exporter
from gpubroker.broker.wire import EngineReport, StatsReport
from gpubroker.cli.live import decision_line, follow_decisions, new_decisions, watch_status
from gpubroker.cli.views import status_table

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "gpubroker.json"


# ------------------------------------------------------------------ builders
def engine_counts(**counts: int) -> EngineReport:
    """An engine's report with these cumulative counts (its geometry: any, the metrics do not read it)."""
    geometry = dict.fromkeys(("running", "waiting", "kv_blocks_total", "kv_blocks_reserved", "max_model_len"), 0)
    ceilings = dict.fromkeys(
        ("max_num_seqs_max", "max_batched_tokens_max", "kv_cache_blocks_min", "kv_cache_blocks_max"), 1
    )
    return EngineReport(kv_block_tokens=16, kv_block_bytes=8192, **geometry, **ceilings, **counts)


def report(model: str = "mlp", **over) -> StatsReport:
    base = dict(
        model=model,
        replica_id="r1",
        seq=0,
        now_s=100.0,
        interval_s=0.5,
        arrivals=12,
        completions=9,
        rejections=2,
        timeouts=1,
        errors=0,
        latency_ms=(5.0, 20.0, 300.0),
        batches=((4.0, 3.0), (5.0, 4.0)),
        batch_requests=(4, 5),
        busy_s=0.007,
        queue_depth=3,
        mem_used_bytes=100 << 20,
        oom_splits=1,
        emergency_shrinks=2,
    )
    base.update(over)
    return StatsReport(**base)


def model_decision(changed: bool = True, trigger: str = "queue_depth", **over) -> ModelDecision:
    base = dict(
        max_batch_size=8,
        batch_wait_timeout_s=0.01,
        grant_bytes=1 << 30,
        admit=True,
        reason="queue_depth 20 > band top 15: grow 4->8",
        trigger=trigger,
        trigger_value=20.0,
        changed=changed,
    )
    base.update(over)
    return ModelDecision(**base)


def decision(profile: str = "offpeak", models=None, moves=()) -> FleetDecision:
    return FleetDecision(
        now_s=100.0,
        profile=profile,
        models=models
        if models is not None
        else {"mlp": model_decision(), "hot": model_decision(changed=False, trigger="hold")},
        moves=tuple(moves),
    )


def model_status(**over) -> dict:
    base = {
        "grant_bytes": 1 << 30,
        "base_bytes": 1 << 30,
        "used_bytes": 200 << 20,
        "max_batch_size": 8,
        "batch_wait_timeout_s": 0.01,
        "batch_unit": "requests",
        "queue_depth": 3,
        "p50_ms": 10.0,
        "p95_ms": 250.0,
        "p99_ms": 300.0,
        "slo_p95_ms": 400.0,
        "attainment": 0.9,
        "completions": 9,
        "misses": 1,
        "arrival_rate_rps": 12.5,
        "completion_rate_rps": 12.0,
        "settings_version": 3,
        "replicas": 1,
        "admit": True,
        "cost_per_1k_requests": 0.0123,
        "cost_unit": "requests",
        "calibrated": True,
        "emergency_shrinks": 0,
        "oom_splits": 0,
    }
    base.update(over)
    return base


def status(**over) -> dict:
    base = {
        "config_hash": "abc123def456",
        "launch_hash": "abc123def456",
        "profile": "offpeak",
        "price_per_gpu_hour": 1.2,
        "dry_run": False,
        "device": "cpu",
        "now_s": 100.0,
        "capacity_bytes": 6 << 30,
        "usable_bytes": 5 << 30,
        "granted_bytes": 2 << 30,
        "used_bytes": 400 << 20,
        "free_frac": 0.8,
        "ticks": 5,
        "last_tick_s": 99.0,
        "restored": False,
        "checkpoint_path": None,
        "decision_seq": 7,
        "models": {
            "mlp": model_status(),
            "hot": model_status(
                grant_bytes=512 << 20, base_bytes=128 << 20, p95_ms=None, cost_per_1k_requests=None, admit=False
            ),
        },
    }
    base.update(over)
    return base


ENGINE_STATUS = {  # an LLM model's status "engine" part (gpubroker.broker.control.llm_window.LlmControl.status)
    "running": 3,
    "waiting": 1,
    "kv_blocks_used": 20,
    "kv_blocks_free": 12,
    "preemptions": 2,
    "ttft_p50_ms": 100.0,
    "ttft_p95_ms": 400.0,
    "ttft_p99_ms": 900.0,
    "tpot_p50_ms": 10.0,
    "tpot_p95_ms": 40.0,
    "tpot_p99_ms": None,
    "tokens_in_per_s": 50.0,
    "tokens_out_per_s": 20.0,
    "ttft_slo_ms": 1500,
    "tpot_slo_ms": 150,
    "max_num_seqs": 6,
    "max_batched_tokens": 256,
    "kv_blocks": 32,
    "prefill_paused": False,
}


def value(m: BrokerMetrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, labels)


@pytest.fixture
def metrics() -> BrokerMetrics:
    return BrokerMetrics(CollectorRegistry(), gpu="cpu", clock=lambda: 1234.5)


# ------------------------------------------------------------------ BrokerMetrics
def test_observe_report_counts_outcomes_histograms_and_events(metrics):
    metrics.observe_report(report())
    metrics.observe_report(
        report(
            seq=1,
            completions=1,
            rejections=0,
            timeouts=0,
            latency_ms=(1.0,),
            batch_requests=(1,),
            batches=((1.0, 1.0),),
            oom_splits=0,
            emergency_shrinks=0,
        )
    )
    lab = {"model": "mlp", "gpu": "cpu"}
    assert value(metrics, "gpubroker_requests_total", outcome="ok", **lab) == 10
    assert value(metrics, "gpubroker_requests_total", outcome="rejected", **lab) == 2
    assert value(metrics, "gpubroker_requests_total", outcome="timeout", **lab) == 1
    assert value(metrics, "gpubroker_requests_total", outcome="error", **lab) == 0  # present at 0
    assert value(metrics, "gpubroker_request_latency_seconds_count", **lab) == 4
    assert value(metrics, "gpubroker_request_latency_seconds_sum", **lab) == pytest.approx(0.326)
    assert value(metrics, "gpubroker_request_latency_seconds_bucket", le="0.025", **lab) == 3  # 1, 5, 20 ms
    assert value(metrics, "gpubroker_batch_size_count", **lab) == 3
    assert value(metrics, "gpubroker_batch_size_bucket", le="4.0", **lab) == 2
    assert value(metrics, "gpubroker_batch_execution_seconds_count", **lab) == 3
    assert value(metrics, "gpubroker_oom_splits_total", **lab) == 1
    assert value(metrics, "gpubroker_emergency_shrinks_total", **lab) == 2
    assert value(metrics, "gpubroker_reports_total", **lab) == 2
    assert value(metrics, "gpubroker_busy_seconds_total", **lab) == pytest.approx(0.014)
    assert value(metrics, "gpubroker_arrivals_total", **lab) == 24


def test_an_engines_running_counts_become_counters(metrics):
    """An LLM engine reports tokens and preemptions since it started: the counters add what grew,
    per replica, and a restarted engine (counts that fell) adds its new count whole."""
    lab = {"model": "chat", "gpu": "cpu"}
    for replica, tokens_in, preemptions in (("a", 100, 1), ("b", 40, 0), ("a", 150, 3), ("a", 20, 0)):
        engine = engine_counts(tokens_in=tokens_in, tokens_out=2 * tokens_in, preemptions=preemptions)
        metrics.observe_report(report("chat", replica_id=replica, engine=engine))
    assert value(metrics, "gpubroker_llm_prompt_tokens_total", **lab) == 100 + 40 + 50 + 20
    assert value(metrics, "gpubroker_llm_generation_tokens_total", **lab) == 2 * (100 + 40 + 50 + 20)
    assert value(metrics, "gpubroker_llm_preemptions_total", **lab) == 3


def test_no_label_comes_from_a_request(metrics):
    metrics.observe_report(report(replica_id="SECRET-replica"))
    metrics.observe_tick(decision(), status(), 0.002)
    metrics.observe_reload(True, "abc123def456")
    allowed = {"model", "gpu", "outcome", "kind", "trigger", "profile", "le", "quantile", "config_hash"}
    for fam in metrics.registry.collect():
        for s in fam.samples:
            assert set(s.labels) <= allowed, (s.name, s.labels)
            assert "SECRET" not in json.dumps(s.labels)
        assert fam.name.startswith("gpubroker_")


def test_observe_tick_sets_gauges_from_status(metrics):
    metrics.observe_tick(decision(), status(), 0.002)
    lab = {"model": "mlp", "gpu": "cpu"}
    assert value(metrics, "gpubroker_quota_granted_bytes", **lab) == 1 << 30
    assert value(metrics, "gpubroker_quota_used_bytes", **lab) == 200 << 20
    assert value(metrics, "gpubroker_quota_base_bytes", **lab) == 1 << 30
    assert value(metrics, "gpubroker_max_batch_requests", **lab) == 8
    assert value(metrics, "gpubroker_max_batch_tokens", **lab) is None  # a requests model: no token cap series
    assert value(metrics, "gpubroker_batch_wait_timeout_seconds", **lab) == 0.01
    assert value(metrics, "gpubroker_queue_depth", **lab) == 3
    assert value(metrics, "gpubroker_window_latency_seconds", quantile="0.5", **lab) == pytest.approx(0.01)
    assert value(metrics, "gpubroker_window_latency_seconds", quantile="0.95", **lab) == pytest.approx(0.25)
    assert value(metrics, "gpubroker_window_latency_seconds", quantile="0.99", **lab) == pytest.approx(0.3)
    assert value(metrics, "gpubroker_latency_slo_seconds", quantile="0.95", **lab) == pytest.approx(0.4)
    assert value(metrics, "gpubroker_slo_attainment_ratio", **lab) == pytest.approx(0.9)
    assert value(metrics, "gpubroker_cost_per_1k_requests", **lab) == pytest.approx(0.0123)
    assert value(metrics, "gpubroker_admit", **lab) == 1
    assert value(metrics, "gpubroker_settings_version", **lab) == 3
    hot = {"model": "hot", "gpu": "cpu"}
    assert math.isnan(value(metrics, "gpubroker_window_latency_seconds", quantile="0.95", **hot))  # NaN, not 0
    assert math.isnan(value(metrics, "gpubroker_cost_per_1k_requests", **hot))
    assert value(metrics, "gpubroker_admit", **hot) == 0
    assert value(metrics, "gpubroker_card_capacity_bytes", gpu="cpu") == 6 << 30
    assert value(metrics, "gpubroker_card_usable_bytes", gpu="cpu") == 5 << 30
    assert value(metrics, "gpubroker_card_granted_bytes", gpu="cpu") == 2 << 30
    assert value(metrics, "gpubroker_active_profile", gpu="cpu", profile="offpeak") == 1
    assert value(metrics, "gpubroker_config_info", config_hash="abc123def456") == 1
    assert value(metrics, "gpubroker_ticks_total", gpu="cpu") == 1
    assert value(metrics, "gpubroker_tick_duration_seconds_count", gpu="cpu") == 1
    assert value(metrics, "gpubroker_tick_duration_seconds_sum", gpu="cpu") == pytest.approx(0.002)


def test_decisions_count_changes_by_trigger_and_moves_by_kind(metrics):
    d = decision(
        models={
            "mlp": model_decision(trigger="p95_ms"),
            "hot": model_decision(changed=False, trigger="hold"),
            "cnn": model_decision(trigger="a free text trigger from somewhere"),
        },
        moves=[
            QuotaMove("lend", "cold", "hot", 64 << 20, "idle"),
            QuotaMove("confirm", "cold", "hot", 64 << 20, "ok"),
            QuotaMove("teleport", None, "hot", 1, "?"),
        ],
    )
    metrics.observe_tick(d, status(), 0.001)
    metrics.observe_tick(d, status(), 0.001)
    assert value(metrics, "gpubroker_decisions_total", model="mlp", gpu="cpu", trigger="p95_ms") == 2
    assert (
        value(metrics, "gpubroker_decisions_total", model="hot", gpu="cpu", trigger="hold") == 0
    )  # unchanged: no count
    assert value(metrics, "gpubroker_decisions_total", model="cnn", gpu="cpu", trigger="other") == 2
    assert value(metrics, "gpubroker_quota_transfers_total", gpu="cpu", kind="lend") == 2
    assert value(metrics, "gpubroker_quota_transfers_total", gpu="cpu", kind="confirm") == 2
    assert value(metrics, "gpubroker_quota_transfers_total", gpu="cpu", kind="other") == 2
    assert value(metrics, "gpubroker_quota_transferred_bytes_total", gpu="cpu", kind="lend") == 128 << 20


def test_profile_switch_and_removed_model(metrics):
    metrics.observe_tick(decision(), status(), 0.001)
    s = status(profile="peak")
    del s["models"]["hot"]
    metrics.observe_tick(decision(profile="peak"), s, 0.001)
    assert value(metrics, "gpubroker_active_profile", gpu="cpu", profile="peak") == 1
    assert value(metrics, "gpubroker_active_profile", gpu="cpu", profile="offpeak") == 0
    assert value(metrics, "gpubroker_max_batch_requests", model="hot", gpu="cpu") is None
    assert value(metrics, "gpubroker_max_batch_requests", model="mlp", gpu="cpu") == 8


def test_a_model_removed_and_added_again_is_exported_again(metrics):
    """The per-model series a tick sets are kept between ticks (``BrokerMetrics._child``); a
    removed model's are dropped with it, so a model that comes back is a live series again."""
    metrics.observe_tick(decision(), status(), 0.001)
    gone = status()
    del gone["models"]["hot"]
    metrics.observe_tick(decision(), gone, 0.001)
    assert value(metrics, "gpubroker_quota_granted_bytes", model="hot", gpu="cpu") is None
    back = status()
    back["models"]["hot"]["grant_bytes"] = 777 << 20
    metrics.observe_tick(decision(), back, 0.001)
    assert value(metrics, "gpubroker_quota_granted_bytes", model="hot", gpu="cpu") == 777 << 20
    card = metrics.for_gpu("c01")  # another card's view: its own series in the same registry
    card.observe_tick(decision(), status(), 0.001)
    assert value(metrics, "gpubroker_quota_granted_bytes", model="hot", gpu="c01") == 512 << 20
    assert value(metrics, "gpubroker_quota_granted_bytes", model="hot", gpu="cpu") == 777 << 20


def test_a_tick_sets_a_models_gauges_only_when_its_values_changed(metrics):
    """A model whose status values are those of the last tick (most models, most ticks) keeps
    the series as they are: the tick does not set them again. The probe: a series changed
    behind the tick's back stays changed until the model's values change. A model removed and
    added again with its old values is exported again, and its engine's series go with it."""
    metrics.observe_tick(decision(), status(), 0.001)
    lab = {"model": "mlp", "gpu": "cpu"}
    metrics.m["quota_granted_bytes"].labels("mlp", "cpu").set(1.0)  # not the tick's doing
    metrics.observe_tick(decision(), status(), 0.001)
    assert value(metrics, "gpubroker_quota_granted_bytes", **lab) == 1.0  # unchanged values: not set
    moved = status()
    moved["models"]["mlp"]["queue_depth"] = 7
    metrics.observe_tick(decision(), moved, 0.001)
    assert value(metrics, "gpubroker_quota_granted_bytes", **lab) == 1 << 30  # a change: every gauge set
    assert value(metrics, "gpubroker_queue_depth", **lab) == 7
    with_engine = status()
    with_engine["models"]["mlp"]["engine"] = {"running": 3}
    metrics.observe_tick(decision(), with_engine, 0.001)
    assert value(metrics, "gpubroker_llm_sequences", model="mlp", gpu="cpu", state="running") == 3
    gone = status()
    del gone["models"]["mlp"]
    metrics.observe_tick(decision(), gone, 0.001)
    assert value(metrics, "gpubroker_quota_granted_bytes", **lab) is None
    assert value(metrics, "gpubroker_llm_sequences", model="mlp", gpu="cpu", state="running") is None
    metrics.observe_tick(decision(), status(), 0.001)  # back, with the values it had
    assert value(metrics, "gpubroker_quota_granted_bytes", **lab) == 1 << 30


def test_a_token_models_batch_cap_has_its_own_metric(metrics):
    """One unit per metric: a cap in tokens is not exported beside caps in requests."""
    s = status()
    s["models"]["hot"].update(batch_unit="tokens", max_batch_size=2048)
    metrics.observe_tick(decision(), s, 0.001)
    assert value(metrics, "gpubroker_max_batch_tokens", model="hot", gpu="cpu") == 2048
    assert value(metrics, "gpubroker_max_batch_requests", model="hot", gpu="cpu") is None
    assert value(metrics, "gpubroker_max_batch_requests", model="mlp", gpu="cpu") == 8


def test_an_engines_status_sets_its_gauges_one_unit_each(metrics):
    metrics.observe_tick(decision(), status(models={"chat": model_status(engine=ENGINE_STATUS)}), 0.001)
    lab = {"model": "chat", "gpu": "cpu"}
    assert value(metrics, "gpubroker_llm_ttft_seconds", quantile="0.95", **lab) == pytest.approx(0.4)
    assert value(metrics, "gpubroker_llm_tpot_seconds", quantile="0.5", **lab) == pytest.approx(0.01)
    assert math.isnan(value(metrics, "gpubroker_llm_tpot_seconds", quantile="0.99", **lab))
    assert value(metrics, "gpubroker_llm_slo_seconds", metric="ttft", quantile="0.95", **lab) == pytest.approx(1.5)
    assert value(metrics, "gpubroker_llm_sequences", state="waiting", **lab) == 1
    assert value(metrics, "gpubroker_llm_kv_blocks", state="free", **lab) == 12
    assert value(metrics, "gpubroker_llm_max_num_seqs", **lab) == 6
    assert value(metrics, "gpubroker_llm_max_batched_tokens", **lab) == 256
    assert value(metrics, "gpubroker_llm_kv_blocks_limit", **lab) == 32
    assert value(metrics, "gpubroker_llm_prefill_paused", **lab) == 0


def families(m: BrokerMetrics) -> dict[str, str]:
    """Exported family name (as Prometheus sees it, ``_total`` included) -> its type."""
    out = {}
    for fam in m.registry.collect():
        out[fam.name + ("_total" if fam.type == "counter" else "")] = fam.type
    return out


def test_metric_types_follow_prometheus_conventions(exported_metrics):
    """Counts are counters, latencies are histograms in seconds, one unit per name, no quantile
    in a name, no rate exported as a gauge."""
    types = families(exported_metrics)
    for name in (
        "gpubroker_requests_total",
        "gpubroker_arrivals_total",
        "gpubroker_reports_total",
        "gpubroker_decisions_total",
        "gpubroker_quota_transfers_total",
        "gpubroker_llm_prompt_tokens_total",
        "gpubroker_llm_generation_tokens_total",
        "gpubroker_llm_preemptions_total",
        "gpubroker_config_reload_failures_total",
    ):
        assert types.get(name) == "counter", (name, types.get(name))
    for name in (
        "gpubroker_request_latency_seconds",
        "gpubroker_batch_execution_seconds",
        "gpubroker_tick_duration_seconds",
        "gpubroker_batch_size",
    ):
        assert types.get(name) == "histogram", (name, types.get(name))
    for name, kind in types.items():
        assert not re.search(r"p\d\d|_rps\b|per_second|_ms\b", name), name  # no quantile, rate or ms in a name
        assert name.endswith("_total") == (kind == "counter"), (name, kind)
    for gone in ("gpubroker_arrival_rate_rps", "gpubroker_latency_p95_seconds", "gpubroker_llm_bound"):
        assert gone not in types
    for fam in exported_metrics.registry.collect():  # a ratio is a share, 0..1
        if fam.name.endswith("_ratio"):
            assert all(0 <= s.value <= 1 for s in fam.samples), fam.samples


def test_histogram_buckets_fit_model_serving_latencies():
    from gpubroker.broker.metrics import LATENCY_BUCKETS_S

    assert LATENCY_BUCKETS_S == tuple(sorted(LATENCY_BUCKETS_S))
    assert LATENCY_BUCKETS_S[0] <= 0.001 and LATENCY_BUCKETS_S[-1] >= 60  # a small net to a long generation
    usual_slos = [b for b in LATENCY_BUCKETS_S if 0.05 <= b <= 2.0]  # fine where the usual caps are
    assert len(usual_slos) >= 10


def test_observe_reload(metrics):
    assert value(metrics, "gpubroker_config_last_reload_success") == 1  # start-up load
    assert value(metrics, "gpubroker_config_last_reload_timestamp_seconds") == 1234.5
    metrics.observe_reload(True, "aaaaaaaaaaaa")
    assert value(metrics, "gpubroker_config_last_reload_success") == 1
    assert value(metrics, "gpubroker_config_last_reload_timestamp_seconds") == 1234.5
    assert value(metrics, "gpubroker_config_reload_failures_total") == 0
    assert value(metrics, "gpubroker_config_info", config_hash="aaaaaaaaaaaa") == 1
    metrics.observe_reload(False, "aaaaaaaaaaaa")
    assert value(metrics, "gpubroker_config_last_reload_success") == 0
    assert value(metrics, "gpubroker_config_reload_failures_total") == 1
    metrics.observe_reload(True, "bbbbbbbbbbbb")
    assert value(metrics, "gpubroker_config_info", config_hash="bbbbbbbbbbbb") == 1
    assert value(metrics, "gpubroker_config_info", config_hash="aaaaaaaaaaaa") is None  # one hash at a time


def test_metrics_never_raise_into_the_broker(metrics, caplog):
    with caplog.at_level(logging.ERROR, logger="gpubroker.metrics"):
        metrics.observe_tick(decision(), {"models": {"mlp": {"grant_bytes": "not a number"}}}, 0.001)
        metrics.observe_report(None)  # type: ignore[arg-type]
    assert "observe_tick failed" in caplog.text and "observe_report failed" in caplog.text


def test_two_instances_with_fresh_registries_do_not_collide():
    BrokerMetrics(CollectorRegistry())
    BrokerMetrics(CollectorRegistry())


# ------------------------------------------------------------------ exporter
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_exporter_serves_metrics_and_port_zero_disables(metrics):
    assert start_exporter(metrics, "127.0.0.1", 0) is None
    metrics.observe_tick(decision(), status(), 0.001)
    exp = start_exporter(metrics, "127.0.0.1", _free_port())
    assert exp is not None
    try:
        text = urllib.request.urlopen(exp.url, timeout=5).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        grant = [s for s in fams["gpubroker_quota_granted_bytes"].samples if s.labels["model"] == "mlp"]
        assert grant[0].value == 1 << 30
    finally:
        exp.close()


def test_exporter_port_in_use_is_logged_not_raised(metrics, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="gpubroker.metrics"):
            assert start_exporter(metrics, "127.0.0.1", port) is None
    assert f"127.0.0.1:{port}" in caplog.text and "broker.metrics_port" in caplog.text


# ------------------------------------------------------------------ dashboard queries
PROMQL_FUNCTIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
    "rate",
    "irate",
    "increase",
    "delta",
    "idelta",
    "changes",
    "resets",
    "deriv",
    "histogram_quantile",
    "label_values",
    "label_replace",
    "label_join",
    "abs",
    "clamp_min",
    "clamp_max",
    "clamp",
    "time",
    "timestamp",
    "vector",
    "scalar",
    "sort",
    "sort_desc",
    "absent",
    "round",
    "ceil",
    "floor",
    "last_over_time",
    "max_over_time",
    "min_over_time",
    "avg_over_time",
    "sum_over_time",
    "count_over_time",
    "quantile_over_time",
    "query_result",
}
PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression (or a Grafana label_values() query) reads.

    Strips Grafana variables, strings, label matchers, range selectors, durations and grouping
    clauses; what is left that is not a function, keyword or number is a metric name. An unknown
    function name is reported as a metric, so a typo fails the check too.
    """
    e = re.sub(r"\$\{?\w+\}?", "", expr)  # $model, ${DS}, $__rate_interval
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', e)  # strings
    e = re.sub(r"\{[^{}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"label_values\(([^,()]*),[^)]*\)", r"(\1)", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call and word in PROMQL_FUNCTIONS:
            continue
        if word in PROMQL_KEYWORDS or re.fullmatch(r"(inf|nan|e\d*)", word, re.I):
            continue
        names.add(word)
    return names


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r}", t["expr"]))
    for a in dash["annotations"]["list"]:
        if "expr" in a:
            out.append((f"annotation {a['name']!r}", a["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']!r}", q))
    return out


def missing_metrics(exprs: list[tuple[str, str]], exported: set[str]) -> list[str]:
    return [
        f"{where}: {name} (in {expr})"
        for where, expr in exprs
        for name in sorted(promql_metric_names(expr))
        if name not in exported
    ]


@pytest.fixture
def exported_metrics() -> BrokerMetrics:
    """A registry with every series the broker exports: a batch model's, an LLM engine's, a move's."""
    m = BrokerMetrics(CollectorRegistry(), gpu="cpu")
    m.observe_report(report())
    m.observe_tick(decision(moves=[QuotaMove("lend", "cold", "hot", 1 << 20, "idle")]), status(), 0.001)
    m.observe_report(report("chat", engine=engine_counts(tokens_in=10, tokens_out=20, preemptions=0)))
    more = {"chat": model_status(engine=ENGINE_STATUS), "tok": model_status(batch_unit="tokens")}
    m.observe_tick(decision(), status(models=more), 0.001)
    return m


@pytest.fixture
def exported(exported_metrics) -> set[str]:
    return exported_metrics.sample_names()


def test_every_dashboard_query_reads_an_exported_metric(exported):
    dash = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dash)
    assert len(exprs) >= 15
    names = set().union(*(promql_metric_names(e) for _, e in exprs))
    assert {
        "gpubroker_max_batch_requests",
        "gpubroker_quota_granted_bytes",
        "gpubroker_card_capacity_bytes",
        "gpubroker_cost_per_1k_requests",
        "gpubroker_decisions_total",
        "gpubroker_queue_depth",
    } <= names
    assert missing_metrics(exprs, exported) == []


RATED = re.compile(r"\b(?:rate|irate|increase)\(\s*([A-Za-z_:][\w:]*)")


def unrated_counts(exprs: list[tuple[str, str]], types: dict[str, str]) -> list[str]:
    """Counters and histogram buckets a query reads raw, and gauges it takes a rate of."""
    bad = []
    for where, expr in exprs:
        rated = set(RATED.findall(expr))
        for name in promql_metric_names(expr):
            is_count = types.get(name) == "counter" or name.endswith("_bucket")
            if is_count != (name in rated):
                bad.append(f"{where}: {name} ({'raw counter' if is_count else 'rate of a gauge'})")
    return bad


def test_dashboard_takes_rates_of_counters_and_reads_gauges_raw(exported_metrics):
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    types = families(exported_metrics)
    assert unrated_counts(exprs, types) == []
    assert unrated_counts([("p", "gpubroker_requests_total"), ("q", "rate(gpubroker_queue_depth[1m])")], types) == [
        "p: gpubroker_requests_total (raw counter)",
        "q: gpubroker_queue_depth (rate of a gauge)",
    ]


def test_dashboard_check_catches_a_missing_metric(exported):
    bad = [
        ("panel 'x'", 'sum by (model) (rate(gpubroker_no_such_metric_total{model=~"$model"}[$__rate_interval]))'),
        ("panel 'y'", "histogram_quantile(0.95, sum by (le) (rate(gpubroker_request_latency_seconds_bucket[5m])))"),
        ("panel 'z'", "histogram_quantil(0.95, gpubroker_batch_size_bucket)"),
    ]
    assert missing_metrics(bad, exported) == [
        "panel 'x': gpubroker_no_such_metric_total (in " + bad[0][1] + ")",
        "panel 'z': histogram_quantil (in " + bad[2][1] + ")",
    ]


def test_promql_parser_pieces():
    assert promql_metric_names('label_values(gpubroker_quota_granted_bytes{gpu=~"$gpu"}, model)') == {
        "gpubroker_quota_granted_bytes"
    }
    assert promql_metric_names("gpubroker_a / on (model) group_left gpubroker_b > 0") == {"gpubroker_a", "gpubroker_b"}
    assert promql_metric_names('max(gpubroker_card_usable_bytes{gpu=~"$gpu"}) * 1e3') == {"gpubroker_card_usable_bytes"}


def test_dashboard_is_importable_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "gpubroker" and dash["panels"]
    ds = [v for v in dash["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert ds and ds[0]["type"] == "datasource" and ds[0]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    assert "batch cap, p95 and queue" in titles and "quota" in titles and "cost per 1k" in titles
    assert any("gpubroker_decisions_total" in a.get("expr", "") for a in dash["annotations"]["list"])


# ------------------------------------------------------------------ live views
def _render(renderable, width: int = 220) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def test_status_table_renders_every_model_and_the_card():
    text = _render(status_table(status()))
    assert "mlp" in text and "hot" in text
    assert "abc123def456" in text and "offpeak" in text
    assert "1.0GiB" in text.replace(" ", "") or "1GiB" in text.replace(" ", "")
    assert "PAUSED" in text  # hot has admit False
    assert "250" in text  # mlp P95


def test_status_table_before_first_tick():
    s = status(free_frac=None, last_tick_s=None, ticks=0)
    s["models"]["mlp"] = model_status(p50_ms=None, p95_ms=None, p99_ms=None, attainment=None, cost_per_1k_requests=None)
    assert "mlp" in _render(status_table(s))


def test_watch_status_refreshes_and_survives_errors():
    calls = []

    def fetch():
        calls.append(1)
        if len(calls) == 3:
            raise ConnectionError("broker restarting")
        return status(ticks=len(calls))

    sleeps = []
    console = Console(record=True, width=220, file=io.StringIO(), color_system=None)
    assert watch_status(fetch, interval_s=0.5, console=console, iterations=3, sleep=sleeps.append) == 3
    assert sleeps == [0.5, 0.5]
    out = console.export_text()  # a non-terminal console keeps the last frame: last good table + the error
    assert len(calls) == 3 and "broker unreachable" in out and "mlp" in out


def test_decision_line_settings_and_move():
    line = decision_line(
        {
            "seq": 5,
            "kind": "settings",
            "time_s": 0,
            "model": "mlp",
            "trigger": "queue_depth",
            "trigger_value": 20.0,
            "reason": "grow",
            "old": {"max_batch_size": 4, "admit": True},
            "new": {"max_batch_size": 8, "admit": True},
        }
    )
    assert (
        line.startswith("#5") and "max_batch_size 4->8" in line and "[queue_depth=20.0]" in line and "admit" not in line
    )
    move = decision_line(
        {
            "seq": 6,
            "kind": "move",
            "time_s": 0,
            "model": "hot",
            "move": "lend",
            "donor": "cold",
            "recipient": "hot",
            "amount_bytes": 64 << 20,
            "reason": "idle",
            "dry_run": True,
        }
    )
    assert "lend cold -> hot" in move and "(dry run)" in move


def test_follow_decisions_emits_each_entry_once_in_order():
    log = [{"seq": i, "kind": "note", "reason": f"n{i}"} for i in range(1, 6)]
    visible = [2, 2, 5, 5]
    seen_since = []

    def fetch(since):
        seen_since.append(since)
        n = visible.pop(0)
        return [e for e in log[:n] if e["seq"] > since][::-1]  # any order in

    emitted = []
    last = follow_decisions(fetch, emitted.append, since_seq=0, interval_s=0.1, iterations=4, sleep=lambda s: None)
    assert [e["seq"] for e in emitted] == [1, 2, 3, 4, 5]
    assert seen_since == [0, 2, 2, 5] and last == 5


def test_follow_decisions_keeps_polling_after_errors():
    errors = []
    answers = [ConnectionError("down"), [{"seq": 3, "kind": "note"}]]

    def fetch(since):
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    emitted = []
    assert (
        follow_decisions(fetch, emitted.append, since_seq=2, iterations=2, sleep=lambda s: None, on_error=errors.append)
        == 3
    )
    assert len(errors) == 1 and [e["seq"] for e in emitted] == [3]
    assert new_decisions([{"seq": 1}], 3) == ([], 3)


# ------------------------------------------------------------------ wired into BrokerCore (no Ray)
CORE_CONFIG = """
broker: {control_interval_s: 0.5, report_interval_s: 0.25, metrics_port: 0}
gpu: {device: cpu, capacity: 2GiB, reserve_frac: 0.0}
models:
  mlp:
    model: mlp
    quota: {min: 256MiB, base: 512MiB, max: 1GiB}
    batch: {floor: 2, ceiling: 64}
    slo_p95_ms: 500
  hot:
    model: profiled
    options: {a_ms: 20, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 4194304}
    quota: {min: 64MiB, base: 128MiB, max: 512MiB}
    batch: {floor: 2, ceiling: 64, initial: 4}
    slo_p95_ms: 1500
"""


def test_broker_core_feeds_its_metrics():
    from gpubroker.broker.core import BrokerCore

    t = [1000.0]
    m = BrokerMetrics(CollectorRegistry(), gpu="cpu")
    core = BrokerCore(CORE_CONFIG, clock=lambda: t[0], metrics=m)
    for i in range(4):
        t[0] += 0.25
        core.report(report(seq=i, now_s=t[0]))
    t[0] += 0.25
    core.tick()
    st = core.status()
    for name, ms in st["models"].items():
        assert value(m, "gpubroker_quota_granted_bytes", model=name, gpu="cpu") == ms["grant_bytes"]
        assert value(m, "gpubroker_max_batch_requests", model=name, gpu="cpu") == ms["max_batch_size"]
    assert value(m, "gpubroker_requests_total", model="mlp", gpu="cpu", outcome="ok") == 36
    assert value(m, "gpubroker_config_info", config_hash=st["config_hash"]) == 1
    assert value(m, "gpubroker_ticks_total", gpu="cpu") == 1
    assert value(m, "gpubroker_card_usable_bytes", gpu="cpu") == st["usable_bytes"]
    bad = core.apply("models: {}\n")
    assert not bad["ok"] and value(m, "gpubroker_config_reload_failures_total") == 1
    assert value(m, "gpubroker_config_last_reload_success") == 0
    good = core.apply(CORE_CONFIG.replace("slo_p95_ms: 500", "slo_p95_ms: 600"))
    assert good["ok"] and value(m, "gpubroker_config_last_reload_success") == 1
    assert value(m, "gpubroker_config_info", config_hash=good["config_hash"]) == 1
    assert value(m, "gpubroker_config_info", config_hash=st["config_hash"]) is None
    BrokerCore(CORE_CONFIG, clock=lambda: t[0])  # default: a private registry, no clash with the first core


# ------------------------------------------------------------------ CLI flags (no Ray: the HTTP path is faked)
def _cli(monkeypatch, answers):
    from typer.testing import CliRunner

    from gpubroker.cli.main import app
    from gpubroker.deployments.cluster import fleet_client

    calls = []

    def fake_get(path, timeout_s=5.0):
        calls.append(path)
        if not answers:
            raise KeyboardInterrupt  # ends the live loop like Ctrl-C
        return answers.pop(0)

    monkeypatch.setattr(fleet_client, "http_get", fake_get)
    return CliRunner(), app, calls


def test_cli_status_watch(monkeypatch):
    runner, app, calls = _cli(monkeypatch, [status(), status(ticks=6)])
    result = runner.invoke(app, ["status", "--watch", "--interval", "0.1"])
    assert result.exit_code == 0, result.output
    assert "mlp" in result.output and calls == ["/v1/status"] * 3


def test_cli_decisions_follow(monkeypatch):
    first = [{"seq": 1, "kind": "note", "time_s": 0, "reason": "first"}]
    later = [{"seq": 2, "kind": "note", "time_s": 0, "reason": "second"}]
    runner, app, calls = _cli(monkeypatch, [first, [], later])
    result = runner.invoke(app, ["decisions", "--follow", "--interval", "0.1", "--json"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in result.output.splitlines() if x.startswith("{")]
    assert [d["seq"] for d in lines] == [1, 2]
    assert calls == [
        "/v1/decisions?since_seq=0",
        "/v1/decisions?since_seq=1",
        "/v1/decisions?since_seq=1",
        "/v1/decisions?since_seq=2",
    ]
