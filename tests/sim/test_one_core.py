"""The simulator runs the live broker: one report sequence, two brokers, the same decisions.

The simulator's broker arm records every call it makes to its ``FleetBroker`` (register,
report, tick, with the virtual time of each). The same calls are then replayed, in order, into
a second ``FleetBroker`` built the way the Ray actor builds it (config text, a clock, real
Prometheus metrics in a private registry, reports as plain data over Ray). If the simulator
added any wiring of its own between the reports and the decisions, the two decision logs would
differ.
"""

from __future__ import annotations

import yaml

from gpubroker.broker.fleet_core import FleetBroker
from gpubroker.broker.wire import StatsReport
from gpubroker.sim import arrivals as arr
from gpubroker.sim.engine import SimOptions, Simulator, parse_arm
from gpubroker.sim.profile import profile_for
from gpubroker.sim.workload import finish
from tests.sim.conftest import GiB, MiB, fleet, profiled


def _fleet_and_workload():
    cfg = fleet(
        {
            "busy": profiled(
                20, 0.5, weights=1 * GiB, per_item=256 * MiB, mn="1.5GiB", base="3GiB", mx="8GiB", slo_ms=60
            ),
            "idle1": profiled(
                10, 1, weights=1 * GiB, per_item=128 * MiB, mn="1.5GiB", base="4GiB", mx="6GiB", slo_ms=80
            ),
            "idle2": profiled(
                10, 1, weights=1 * GiB, per_item=128 * MiB, mn="1.5GiB", base="4GiB", mx="6GiB", slo_ms=80
            ),
        },
        capacity="12.5GiB",
    )
    times = arr.burst([60.0, 40.0, 40.0], busy=0, duration_s=70, start_s=20, length_s=30, seed=2)
    w = {n: finish(t, profile_for(n, cfg.models[n]), None, 0) for n, t in zip(cfg.models, times)}
    return cfg, w


def test_live_core_and_simulator_core_decide_the_same():
    cfg, w = _fleet_and_workload()
    sim = Simulator(cfg, parse_arm("broker"), w, 70.0, opts=SimOptions(record=True))
    sim.run()
    trace = sim.broker.trace
    sim_log = sim.broker.broker.decisions()
    assert any(e["kind"] == "move" for e in sim_log), "the scenario must move quota"
    assert sum(1 for e in sim_log if e["kind"] == "settings") > 10

    now = [0.0]
    text = yaml.safe_dump(cfg.model_dump(mode="json"))
    live = FleetBroker(text, capacity_bytes=sim.capacity, clock=lambda: now[0])
    for kind, t, payload in trace:
        now[0] = t
        if kind == "register":
            live.register(*payload)
        elif kind == "report":
            live.report(StatsReport.from_dict(payload.to_dict()))  # the replicas' path: plain data over Ray
        else:
            live.tick()
    assert live.decisions() == sim_log
    assert live.status()["models"] == sim.broker.broker.status()["models"]


def test_the_replicas_waiting_count_matches_the_requests_it_holds():
    """The simulator keeps each replica's ``waiting`` (what it reports as queue depth and
    checks against ``max_queued``) as a counter; it must equal the requests still pending."""
    import numpy as np

    from gpubroker.sim.types import PENDING

    cfg, w = _fleet_and_workload()
    sim = Simulator(cfg, parse_arm("broker"), w, 70.0, opts=SimOptions(drain_s=0.0))  # stops with requests in flight
    sim.run()
    for m, reps in enumerate(sim.replicas):
        pending = int(np.sum((sim.status == PENDING) & (sim.m_np == m)))
        assert sum(r.held for r in reps) == pending
