"""A card lost in the simulator: the fleet broker marks it lost and re-places its models.

The simulator emulates card a0 of a two-node fleet (``gpubroker.quotas.card_fleet``) and drives the
fleet's ``FleetBroker`` (the object the Ray actor wraps) with re-placement on. At 20 s of
virtual time a0's reports stop, as when its node is gone: after ``DEAD_AFTER_S`` the broker
marks a0 lost, re-places ``mover`` on b0 (it fits) and reports ``pinned`` (it may only run on a0)
unplaced with its reason; b0 never holds more than it can grant.
"""

from __future__ import annotations

from gpubroker.broker.fleet_core import DEAD_AFTER_S
from gpubroker.quotas.card_fleet import card_fleet
from gpubroker.quotas.config import parse_config
from gpubroker.sim import arrivals as arr
from gpubroker.sim.engine import Simulator, parse_arm
from gpubroker.sim.profile import profile_for
from gpubroker.sim.workload import finish
from tests.sim.conftest import profiled

LOST_AT_S = 20.0


def _fleet():
    models = {
        "mover": profiled(10, 1, base="4GiB", mx="6GiB"),
        "pinned": profiled(10, 1, base="4GiB", mx="6GiB", placement={"cards": ["a0"]}),
        "resident": profiled(10, 1, base="4GiB", mx="6GiB", placement={"cards": ["b0"]}),
    }
    doc = {
        "broker": {"control_interval_s": 1.0, "report_interval_s": 0.5},
        "gpu": {"reserve_frac": 0.12},
        "gpus": [
            {"id": "a0", "node": "node-a", "index": 0, "capacity": "12GiB", "device": "cpu"},
            {"id": "b0", "node": "node-b", "index": 0, "capacity": "12GiB", "device": "cpu"},
        ],
        "models": models,
    }
    return parse_config(doc)


def test_a_card_whose_reports_stop_is_lost_and_its_models_re_placed():
    fleet = _fleet()
    cfg = card_fleet(fleet, "a0")
    assert set(cfg.models) == {"mover", "pinned"}
    duration = LOST_AT_S + DEAD_AFTER_S + 10.0
    times = [arr.poisson(20.0, duration, seed=i) for i in range(len(cfg.models))]
    w = {n: finish(t, profile_for(n, cfg.models[n]), None, 0) for n, t in zip(cfg.models, times)}
    sim = Simulator(cfg, parse_arm("broker"), w, duration)
    sim.broker_options = {"fleet": fleet, "card": "a0", "lost_at_s": LOST_AT_S}
    sim.run()
    fb = sim.broker.broker

    assert fb.lost == {"a0"}
    plan = fb.plan()
    assert plan.version == 1 and plan.replacing
    assert plan.groups["mover"] == {"b0": 1} and plan.groups["resident"] == {"b0": 1}
    assert plan.groups["pinned"] == {} and "no live card" in plan.unplaced["pinned"]
    assert {t.card_id for t in plan.replica_targets} == {"b0"}  # a lost card is not scaled
    log = fb.decisions()
    lost = [e for e in log if e["kind"] == "card" and "lost" in e["reason"]]
    assert lost and lost[0]["time_s"] - sim.epoch0 >= LOST_AT_S + DEAD_AFTER_S
    assert any(e["kind"] == "placement" and e["model"] == "mover" for e in log)
    b0 = next(c for c in fb.status()["cards"] if c["id"] == "b0")
    assert b0["granted_bytes"] <= b0["usable_bytes"]
    # before the loss the simulated card was governed: its models got settings changes
    assert any(e["kind"] == "settings" and e.get("card") == "a0" for e in log)
