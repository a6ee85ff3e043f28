"""shed_late: a request held at the gate that can no longer meet its SLO is answered 504 at once.

The rule (``gpubroker.deployments.replica.shed.LateShed``) is pure; the replica tests run the real
``ModelReplica`` in-process on Serve's real batcher beside an in-process broker core, with a
``profiled`` model (EMULATION: it sleeps a + c*b ms; there is no GPU here).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from gpubroker.broker.metrics import BrokerMetrics
from gpubroker.deployments.replica.broker_link import StatsDelta
from gpubroker.deployments.replica.deployment import ModelReplica
from gpubroker.deployments.replica.shed import HeldRequest, LateShed
from gpubroker.quotas.config import parse_config_text
from gpubroker.quotas.config_errors import ConfigError
from tests.unit.test_metrics import report, value
from tests.unit.test_replica_lazy_formation import _replica


def test_too_late_counts_the_wait_and_the_last_batch():
    s = LateShed(slo_s=0.4)
    assert not s.too_late(0.4)  # before any batch ran, only the wait counts; at the SLO it still fits
    assert s.too_late(0.41)
    s.batch_ran(0.15)
    assert not s.too_late(0.25) and s.too_late(0.26)
    s.batch_ran(-1.0)  # a clock step back is no negative estimate
    assert s.last_batch_s == 0.0


def test_a_request_of_more_than_one_cap_counts_every_batch_it_still_needs():
    s = LateShed(slo_s=0.4, last_batch_s=0.1)
    assert s.check("m", HeldRequest(10.0, [1] * 8), now_s=10.05, cap=8) is None  # one batch: 50 + 100 ms
    req = HeldRequest(10.0, [1] * 8)
    late = s.check("m", req, now_s=10.05, cap=2)  # four batches: 50 + 400 ms
    assert late is not None and "its 4 batches" in late.detail
    assert s.check("m", req, now_s=10.0, cap=100) is late  # the verdict holds for its other items
    big = HeldRequest(10.0, [500])  # one item costlier than the cap runs alone: one batch
    assert s.check("m", big, now_s=10.05, cap=64) is None
    two = HeldRequest(10.0, [1, 1, 1])
    two.let_in(1)  # one left for a batch: two still held, two batches of 1: 150 + 200 ms fits ...
    assert s.check("m", two, now_s=10.15, cap=1) is None
    assert s.check("m", HeldRequest(10.0, [1, 1, 1]), now_s=10.15, cap=1) is not None  # ... three do not


def test_the_504_names_the_wait_the_batch_the_slo_and_the_way_out():
    s = LateShed(slo_s=0.4, last_batch_s=0.15)
    d = s.detail("late", 0.3)
    for part in ("shed:", "waited 300 ms", "model 'late'", "~150 ms", "slo_p95_ms (400 ms)", "shed_late: false"):
        assert part in d, (part, d)


def test_shed_late_is_refused_on_an_llm_engine_naming_the_field():
    text = """
gpu: {device: cpu, capacity: 4GiB}
models:
  chat: {kind: llm, model: tiny-llama, quota: {min: 256MiB, base: 1GiB, max: 2GiB}, shed_late: true}
"""
    with pytest.raises(ConfigError) as e:
        parse_config_text(text, "test")
    assert "shed_late" in str(e.value) and "chat" in str(e.value)


def test_shed_late_without_the_lazy_gate_is_refused_naming_the_model_and_the_fix():
    for broker, control in (("batch_formation: eager", "{}"), ("batch_formation: lazy", "{strategy: static}")):
        text = f"""
broker: {{{broker}}}
gpu: {{device: cpu, capacity: 1GiB}}
models:
  late: {{model: mlp, quota: {{min: 64MiB, base: 128MiB, max: 128MiB}}, control: {control}, shed_late: true}}
"""
        with pytest.raises(ConfigError) as e:
            parse_config_text(text, "test")
        assert "models.late.shed_late" in str(e.value) and "batch_formation: lazy" in str(e.value)
    ok = parse_config_text(text.replace("shed_late: true", "shed_late: false"), "test")
    assert not ok.models["late"].shed_late


def test_shed_requests_are_timeouts_and_a_shed_outcome_of_their_own():
    metrics = BrokerMetrics(CollectorRegistry(), gpu="cpu", clock=lambda: 1.0)
    metrics.observe_report(report(timeouts=5, shed=3))
    lab = {"model": "mlp", "gpu": "cpu"}
    assert value(metrics, "gpubroker_requests_total", outcome="timeout", **lab) == 2
    assert value(metrics, "gpubroker_requests_total", outcome="shed", **lab) == 3
    old, new = StatsDelta(0.0, timeouts=2, shed=2), StatsDelta(1.0, shed=1)
    new.merge(old)  # a delta the broker never got is folded into the next, sheds included
    assert new.shed == 3 and new.timeouts == 2


CONFIG = """
broker: {{name: rshed, namespace: rshed, control_interval_s: 5, report_interval_s: 5, metrics_port: 0}}
gpu: {{device: cpu, capacity: 1GiB, reserve_frac: 0.0}}
models:
  prof:
    model: profiled
    options: {{a_ms: 150, c_ms: 0, weights_bytes: 1048576, bytes_per_item: 0}}
    quota: {{min: 16MiB, base: 128MiB, max: 128MiB}}
    batch: {{floor: 1, ceiling: 1, initial: 1}}
    wait: {{min_ms: 0, max_ms: 1, initial_ms: 0}}
    slo_p95_ms: 400
    shed_late: {shed}
"""


async def _burst(shed: bool, monkeypatch, tmp_path, n: int = 8) -> tuple[ModelReplica, list[dict], list[int], float]:
    text = CONFIG.format(shed="true" if shed else "false")
    r, sizes = await _replica(text, monkeypatch, tmp_path / f"shed-{shed}.json")
    assert (await r.infer([{}]))["status"] == 200  # one batch ran alone: the replica knows its batch time
    sizes.clear()
    t0 = time.monotonic()
    out = await asyncio.gather(*(r.infer([{}]) for _ in range(n)))
    return r, out, sizes, time.monotonic() - t0


def test_an_overloaded_replica_sheds_what_cannot_meet_the_slo_and_runs_the_rest(monkeypatch, tmp_path):
    """Batches of one that take 150 ms, an SLO of 400 ms, 8 requests at once: the first two can
    still make it (150 and 300 ms); the rest have waited ~300 ms when the second batch ends and
    would end at ~450 ms, so each gets 504 then, without reaching the model."""
    r, out, sizes, _ = asyncio.run(_burst(True, monkeypatch, tmp_path))
    statuses = [o["status"] for o in out]
    assert set(statuses) <= {200, 504}, statuses  # nothing lost, nothing else
    ok, shed = statuses.count(200), statuses.count(504)
    assert ok >= 2 and shed >= 4, statuses
    assert sum(sizes) == ok  # the shed requests never reached the model
    for o in out:
        if o["status"] == 504:
            assert o["shed"] is True and o["detail"].startswith("shed: waited") and "'prof'" in o["detail"]
            assert o["detail"].find("slo_p95_ms (400 ms)") > 0
    assert r.delta.shed == shed and r.delta.timeouts >= shed


def test_without_shed_late_every_request_is_answered_late(monkeypatch, tmp_path):
    r, out, sizes, elapsed = asyncio.run(_burst(False, monkeypatch, tmp_path))
    assert [o["status"] for o in out] == [200] * 8
    assert sum(sizes) == 8 and r.delta.shed == 0
    assert elapsed > 8 * 0.15 * 0.9  # all of them ran, one after the other


def test_a_request_of_several_items_is_shed_whole_and_its_neighbour_still_runs(monkeypatch, tmp_path):
    """Four items in one request on batches of one (150 ms, SLO 400 ms): the first starts at
    once; when it ends the other three still need three batches (150 + 3 x 150 ms > 400), so the
    request is answered 504 then, and none of them reaches the model; a one-item request sent
    250 ms in finds the replica idle and is served."""

    async def main():
        r, _out, sizes, _ = await _burst(True, monkeypatch, tmp_path, n=0)
        sizes.clear()
        a = asyncio.ensure_future(r.infer([{}, {}, {}, {}]))
        await asyncio.sleep(0.25)
        b = asyncio.ensure_future(r.infer([{}]))
        return r, await a, await b, sizes

    r, a, b, sizes = asyncio.run(main())
    assert a["status"] == 504 and a["shed"] is True and "its 3 batches" in a["detail"], a
    assert b["status"] == 200, b
    assert sum(sizes) == 2, sizes  # the shed request's first item, and the neighbour
    assert r.delta.shed == 4  # counted per item, as arrivals and timeouts are
