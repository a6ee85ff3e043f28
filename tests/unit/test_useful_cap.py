"""A lazy cap stops at the useful batch (``gpubroker.broker.control.batch_plan.useful_batch``).

On a nearly linear curve batching buys little: L(b) = 13 + 15 b ms (MiniLM's per request) reaches
90 % of its top throughput (1/c) at b = 9 a / c = 7.8. Overloaded (80/s against the 67/s no batch
serves), the lazy plan had asked for the ceiling and the queue rule doubled towards it; the gate then
let whole queues into 1-2 s batches. Now no rule grows the cap past max(b_lat, useful). A steep curve
(L = 20 + 0.5 b: useful 360, past the ceiling) still grows to the ceiling under a backlog.
"""

from __future__ import annotations

import math
from dataclasses import replace

from gpubroker.broker.control.batch_plan import PlanTarget, plan_batch, useful_batch
from gpubroker.broker.control.latency_model import LatencyFit
from gpubroker.broker.wire import StatsReport
from tests.unit.test_rules import Fleet, Load

LINEAR = LatencyFit(13.0, 15.0, 100)
STEEP = LatencyFit(20.0, 0.5, 100)


def test_useful_batch_is_where_throughput_reaches_the_fraction_of_its_top():
    b = useful_batch(LINEAR)
    assert math.isclose(b, 9 * 13.0 / 15.0)
    assert math.isclose(LINEAR.saturated_rate(b) / (1000.0 / LINEAR.c_ms), 0.9)
    assert useful_batch(LatencyFit(13.0, 0.0, 1)) == math.inf


def test_the_lazy_plan_caps_an_overloaded_linear_curve_at_the_useful_batch():
    over = plan_batch(LINEAR, 80.0, 1.0, PlanTarget(214.0, "balanced", 128, "lazy"))  # 80/s x 15 ms > 1
    assert not math.isfinite(over.rho)  # the fit says no batch keeps up
    assert over.cap == max(over.b_lat, useful_batch(LINEAR)) < 10
    steep = plan_batch(STEEP, 3000.0, 1.0, PlanTarget(59.5, "balanced", 128, "lazy"))
    assert steep.cap == 128  # batching still buys throughput here: the ceiling


class LinearFleet(Fleet):
    """test_rules' fake replica, reporting batch timings of the linear curve."""

    def _report(self, load: Load) -> StatsReport:
        rep = super()._report(load)
        return replace(rep, batches=tuple((float(b), 13.0 + 15.0 * b) for b, _ in rep.batches), busy_s=0.5)


def test_no_rule_grows_a_linear_curves_cap_past_the_useful_batch_under_a_backlog():
    f = LinearFleet(initial=4, slo=214.0)
    f.run(20, Load(rate_rps=80.0, queue=200, latency_ms=(400.0,)))
    assert f.cap() <= math.ceil(max(useful_batch(LINEAR), LatencyFit(13.0, 15.0, 1).largest_batch_within(107.0)))
    steep = Fleet(initial=8)  # L = 20 + 0.5 b: the same backlog grows the cap to the ceiling
    steep.run(20, Load(rate_rps=3000.0, queue=400, latency_ms=(90.0,)))
    assert steep.cap() == 128
