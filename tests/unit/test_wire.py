"""The wire (``gpubroker.broker.wire``): typed on both sides, plain data over Ray, nothing lost on the way."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from typing import Any

import pytest

from gpubroker.broker.actor import BrokerActor
from gpubroker.broker.client import BrokerClient
from gpubroker.broker.fleet_core import FleetBroker
from gpubroker.broker.wire import (
    BrokerApi,
    EngineBounds,
    EngineReport,
    ModelSettings,
    ServePlan,
    StatsReport,
    WireError,
)
from tests.unit.test_fleet_replace import CONFIG


def _over_ray(obj: dict) -> dict:
    return json.loads(json.dumps(obj))  # what survives: plain JSON-like data (tuples become lists)


def test_settings_with_engine_bounds_round_trip_as_plain_data():
    s = ModelSettings("chat", 4, 8, 0.01, 1 << 30, engine=EngineBounds(8, 2048, 512, False, 1 << 28))
    assert ModelSettings.from_dict(_over_ray(s.to_dict())) == s
    assert isinstance(ModelSettings.from_dict(_over_ray(s.to_dict())).engine, EngineBounds)
    # a checkpoint from an older broker may carry a retired field: it is dropped
    assert ModelSettings.from_dict({**s.to_dict(), "retired": 1}) == s


def test_a_report_round_trips_with_its_tuples():
    r = StatsReport("m", "r1", 3, 100.0, 0.5, arrivals=4, latency_ms=(1.0, 2.0), batches=((2.0, 5.0),), card_id="a0")
    assert StatsReport.from_dict(_over_ray(r.to_dict())) == r


ENGINE = EngineReport(
    running=3,
    waiting=1,
    kv_blocks_total=8,
    kv_blocks_reserved=6,
    kv_block_tokens=128,
    kv_block_bytes=256 * 1024,
    max_model_len=512,
    max_num_seqs_max=32,
    max_batched_tokens_max=4096,
    kv_cache_blocks_min=5,
    kv_cache_blocks_max=80,
    model="chat",
    tokens_out=640,
    ttft_p95_ms=120.0,
)


def test_an_llm_report_carries_its_engine_report_typed_both_sides_of_ray():
    r = StatsReport("chat", "chat-r0", 1, 100.0, 0.5, engine=ENGINE)
    back = StatsReport.from_dict(_over_ray(r.to_dict()))
    assert back == r and isinstance(back.engine, EngineReport) and back.engine.ttft_p95_ms == 120.0


def test_the_plan_round_trips_and_names_only_live_cards():
    fb = FleetBroker(CONFIG, clock=lambda: 1_000_000.0)
    fb.tick()
    plan = fb.plan()
    assert ServePlan.from_dict(_over_ray(plan.to_dict())) == plan
    assert plan.groups["spread"] == {"a0": 1, "b0": 1} and plan.version == 0 and not plan.replacing


@pytest.mark.parametrize("side", [BrokerActor, BrokerClient])
def test_the_actor_and_the_client_offer_every_method_of_the_protocol_with_its_parameters(side):
    names = [n for n, v in vars(BrokerApi).items() if inspect.iscoroutinefunction(v)]
    assert len(names) >= 15
    for name in names:
        theirs = inspect.signature(getattr(BrokerApi, name)).parameters
        ours = inspect.signature(getattr(side, name)).parameters
        assert [p for p in ours if p != "_ray_trace_ctx"] == list(theirs), name  # ray.remote adds that one


# ------------------------------------------------------------------ unknown fields: dropped and logged, both ways
def _dropped(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpubroker.wire"]


def test_a_newer_replicas_report_reaches_the_broker_without_its_unknown_field(caplog):
    r = StatsReport("m", "r1", 3, 100.0, 0.5, arrivals=4, card_id="a0")
    newer = {**r.to_dict(), "gpu_temp_c": 71.0}  # a field this broker does not know
    with caplog.at_level(logging.WARNING, logger="gpubroker.wire"):
        assert StatsReport.from_dict(_over_ray(newer)) == r
        assert StatsReport.from_dict(_over_ray(newer)) == r  # logged once, not per report
    [line] = _dropped(caplog)
    assert "StatsReport" in line and "'gpu_temp_c'" in line


def test_a_newer_brokers_reply_and_plan_reach_the_serve_side_without_their_unknown_fields(caplog):
    s = ModelSettings("m", 4, 8, 0.01, 1 << 30, engine=EngineBounds(8, 2048, 512, False, 1 << 28))
    newer = {**s.to_dict(), "speculative": True}
    newer["engine"] = {**newer["engine"], "spec_tokens": 4}
    plan = ServePlan(1, {"m": {"a0": 1}}, {}, (), replacing=True, dry_run=False)
    newer_plan = {**plan.to_dict(), "drain_cards": ["a1"]}
    newer_plan["replica_targets"] = [{"model": "m", "card_id": "a0", "replicas": 2, "why": "busy"}]
    with caplog.at_level(logging.WARNING, logger="gpubroker.wire"):
        assert ModelSettings.from_dict(_over_ray(newer)) == s
        got = ServePlan.from_dict(_over_ray(newer_plan))
    assert got.replica_targets[0].replicas == 2 and got.version == 1
    dropped = " ".join(_dropped(caplog))
    for name in ("'speculative'", "'spec_tokens'", "'drain_cards'", "'why'"):
        assert name in dropped


def test_a_newer_engines_report_reaches_the_broker_without_its_unknown_field(caplog):
    newer = StatsReport("chat", "chat-r0", 1, 100.0, 0.5, engine=ENGINE).to_dict()
    newer["engine"] = {**newer["engine"], "spec_accept_frac": 0.7}  # a field this broker does not know
    with caplog.at_level(logging.WARNING, logger="gpubroker.wire"):
        assert StatsReport.from_dict(_over_ray(newer)).engine == ENGINE
    [line] = _dropped(caplog)
    assert "EngineReport" in line and "'spec_accept_frac'" in line


def test_an_engine_report_without_its_cache_geometry_names_the_field():
    data = ENGINE.to_dict()
    del data["kv_block_bytes"]
    with pytest.raises(WireError, match="EngineReport: missing field.*kv_block_bytes"):
        EngineReport.from_dict(data)


def test_a_missing_required_field_names_itself():
    data = StatsReport("m", "r1", 0, 1.0, 1.0).to_dict()
    del data["replica_id"]
    with pytest.raises(WireError, match="StatsReport: missing field.*replica_id"):
        StatsReport.from_dict(data)


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    async def remote(self, *args: Any) -> Any:
        return _over_ray(await self.fn(*_over_ray(list(args))))  # plain JSON-like data each way, as over Ray


class _Handle:
    """``handle.<method>.remote(...)`` in front of an in-process actor, or a newer one (``extra``)."""

    def __init__(self, actor: BrokerActor, extra: dict[str, Any] | None = None) -> None:
        self.actor, self.extra = actor, extra or {}

    def __getattr__(self, name: str) -> _Method:
        fn = getattr(self.actor, name)

        async def newer(*args: Any) -> Any:
            out = await fn(*args)
            return {**out, **self.extra} if isinstance(out, dict) and name in ("report", "plan") else out

        return _Method(newer)


def test_the_client_speaks_wire_types_to_the_actor_over_plain_data(tmp_path, caplog):
    async def body() -> None:
        actor = BrokerActor(CONFIG, checkpoint_path=str(tmp_path / "b.checkpoint.json"))
        client = BrokerClient(_Handle(actor, extra={"from_a_newer_broker": 1}), timeout_s=5.0)
        got = await client.register("spread", "r1", {"weights_bytes": 1 << 20}, "a0")
        assert isinstance(got, ModelSettings) and got.model == "spread"
        reply = await client.report(StatsReport("spread", "r1", 0, 1.0, 1.0, arrivals=3, card_id="a0"))
        assert reply == got  # no tick in between: the same settings
        plan = await client.plan()
        assert isinstance(plan, ServePlan) and plan.groups["spread"] == {"a0": 1, "b0": 1}
        assert (await client.status())["models"]["spread"]["replicas"] >= 1
        assert (await client.apply("not: [valid"))["ok"] is False
        assert set(await client.card_health()) == {"lost", "silent"}

    with caplog.at_level(logging.WARNING, logger="gpubroker.wire"):
        asyncio.run(body())
    assert any("'from_a_newer_broker'" in m for m in _dropped(caplog))
