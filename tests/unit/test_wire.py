"""The wire (``gpubroker.broker.wire``): typed on both sides, plain data over Ray, nothing lost on the way."""

from __future__ import annotations

import inspect
import json

from gpubroker.broker.actor import BrokerActor
from gpubroker.broker.fleet_core import FleetBroker
from gpubroker.broker.wire import BrokerApi, EngineBounds, ModelSettings, ServePlan, StatsReport
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


def test_the_plan_round_trips_and_names_only_live_cards():
    fb = FleetBroker(CONFIG, clock=lambda: 1_000_000.0)
    fb.tick()
    plan = fb.plan()
    assert ServePlan.from_dict(_over_ray(plan.to_dict())) == plan
    assert plan.groups["spread"] == {"a0": 1, "b0": 1} and plan.version == 0 and not plan.replacing


def test_the_actor_offers_every_method_of_the_protocol_with_its_parameters():
    names = [n for n, v in vars(BrokerApi).items() if inspect.iscoroutinefunction(v)]
    assert len(names) >= 15
    for name in names:
        theirs = inspect.signature(getattr(BrokerApi, name)).parameters
        ours = inspect.signature(getattr(BrokerActor, name)).parameters
        assert [p for p in ours if p != "_ray_trace_ctx"] == list(theirs), name  # ray.remote adds that one
