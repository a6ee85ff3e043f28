"""The replica rule (``gpubroker.broker.control.replica_rules``): fewer replicas under ``throughput`` when larger
batches carry the load, the configured count otherwise; raise at once, lower after a held spell.

The latency model is the ``profiled`` emulation's (a = 20 ms, c = 0.5 ms per request). At the
throughput objective's utilisation (0.7) a replica whose cap is 64 carries up to
0.7 / (20/64 + 0.5) = 0.86 requests/ms (861 req/s), so 2000 req/s needs 3 replicas; with a cap
of 16 it carries 400 req/s and 2000 req/s needs 5 (more than the 4 configured).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpubroker.broker.control.latency_model import LatencyFit
from gpubroker.broker.control.replica_rules import (
    RULES,
    ReplicaInputs,
    ReplicaParams,
    ReplicaRule,
    ReplicaState,
    ReplicaTrigger,
    carries,
    decide,
    initial_state,
    needed,
    planned_batch,
)

FIT = LatencyFit(a_ms=20.0, c_ms=0.5, samples=50)
PARAMS = ReplicaParams(lower_after_s=10.0)


def inp(**kw) -> ReplicaInputs:
    base = dict(
        now_s=1000.0,
        configured=4,
        live=4,
        objective="throughput",
        arrival_rate_rps=2000.0,
        unit_per_request=1.0,
        fit=FIT,
        batch_cap=64,
        slo_ms=1500.0,
    )
    base.update(kw)
    return ReplicaInputs(**base)


def run(rates, state: ReplicaState, params: ReplicaParams = PARAMS, step_s: int = 1, **kw):
    """Decide once per second (integer ticks) over ``rates``; the decisions and the last state."""
    out = []
    for i, rate in enumerate(rates):
        d, state = decide(inp(now_s=1000.0 + i * step_s, arrival_rate_rps=rate, **kw), state, params)
        out.append(d)
    return out, state


def test_the_planned_batch_at_the_throughput_utilisation():
    b = planned_batch(FIT, 800.0, 1.0, 0.7)  # lambda 0.8/ms: b = 0.8*20 / (0.7 - 0.4) = 53.3
    assert b == pytest.approx(53.33, rel=1e-3)
    assert planned_batch(FIT, 1500.0, 1.0, 0.7) is None  # lambda c = 0.75 > 0.7: no batch does
    assert planned_batch(FIT, 0.0, 1.0, 0.7) == 1.0


def test_larger_batches_carry_the_load_on_fewer_replicas():
    assert not carries(inp(), 2) and carries(inp(), 3)
    assert needed(inp(), PARAMS) == 3
    # the grant-limited cap is what lets fewer replicas carry it: at 16 no count up to 4 does
    small = inp(batch_cap=16)
    assert not carries(small, 4) and needed(small, PARAMS) == 4
    # nor when the SLO cannot hold the batch and its fill time (over 100 ms at 3 or 4 replicas)
    assert needed(inp(slo_ms=60.0), PARAMS) == 4


def test_throughput_lowers_only_after_the_lower_count_held():
    decisions, state = run([2000.0] * 12, initial_state(4))
    held = [d for d in decisions if d.target == 4]
    assert len(held) == 10 and all(d.rule == ReplicaRule.HOLD for d in held)  # 10 s of carried load first
    lower = decisions[10]
    assert (lower.rule, lower.old, lower.target, lower.changed) == (ReplicaRule.LOWER, 4, 3, True)
    assert lower.trigger == ReplicaTrigger.ARRIVAL_RATE_RPS and lower.trigger_value == 2000.0
    assert "lower 4->3" in lower.reason and "batch <= 64" in lower.reason
    assert state.target == 3 and decisions[11].rule == ReplicaRule.HOLD and not decisions[11].changed


def test_a_lower_goes_to_the_highest_count_wanted_during_the_spell():
    # 500 req/s wants 1 replica, 2000 req/s wants 3: the spell ends at 3, not at the dip's 1
    _, state = run([500.0] * 5 + [2000.0] * 7, initial_state(4))
    assert state.target == 3
    # an idle spell lowers to the floor
    _, state = run([0.0] * 11, initial_state(4))
    assert state.target == 1


def test_raise_at_once_when_the_load_needs_it():
    d, state = decide(inp(arrival_rate_rps=2000.0), ReplicaState(1), PARAMS)
    assert (d.rule, d.old, d.target) == (ReplicaRule.RAISE, 1, 3) and state.target == 3
    # beyond what every replica carries: all of them
    d, _ = decide(inp(arrival_rate_rps=5000.0), ReplicaState(2), PARAMS)
    assert (d.rule, d.target, d.needed) == (ReplicaRule.RAISE, 4, 4)


def test_a_burst_ends_the_lower_spell():
    decisions, state = run([2000.0] * 8 + [3000.0] + [2000.0] * 8, initial_state(4))
    assert decisions[8].rule == ReplicaRule.HOLD and state.lower_since_s is not None
    assert all(d.target == 4 for d in decisions)  # 8 s, then 8 s: neither spell reached 10 s
    assert state.lower_since_s == 1009.0  # the spell restarted after the burst


@pytest.mark.parametrize("objective", ["latency", "balanced"])
def test_off_peak_raises_back_to_the_configured_count_at_once(objective):
    d, state = decide(inp(objective=objective, arrival_rate_rps=10.0), ReplicaState(1), PARAMS)
    assert (d.rule, d.trigger, d.old, d.target) == (ReplicaRule.CONFIGURED, ReplicaTrigger.OBJECTIVE, 1, 4)
    assert d.trigger_value == 4.0 and f"objective {objective}" in d.reason
    assert state == ReplicaState(4)


def test_without_a_latency_fit_the_configured_count():
    d, _ = decide(inp(fit=None, arrival_rate_rps=0.0), ReplicaState(2), PARAMS)
    assert (d.rule, d.target) == (ReplicaRule.CONFIGURED, 4) and "no latency fit" in d.reason


def test_no_lower_while_serve_still_starts_replicas():
    decisions, state = run([0.0] * 15, ReplicaState(4), live=3)
    assert all(d.target == 4 for d in decisions) and "3 live" in decisions[-1].reason
    assert state.lower_since_s is None


def test_bounds_min_replicas_and_configured():
    _, state = run([0.0] * 12, initial_state(4), ReplicaParams(lower_after_s=10.0, min_replicas=2))
    assert state.target == 2
    d, _ = decide(inp(arrival_rate_rps=0.0, configured=3), ReplicaState(6), PARAMS)  # the config shrank
    assert d.old == 6 and d.target == 3 and d.changed
    d, _ = decide(inp(arrival_rate_rps=0.0, configured=1), ReplicaState(1), ReplicaParams(min_replicas=2))
    assert d.target == 1  # never above the configured count, even under min_replicas


def test_params_refuse_bad_values_naming_the_field():
    with pytest.raises(ValueError, match=r"min_replicas \(0\) must be at least 1"):
        ReplicaParams(min_replicas=0)
    with pytest.raises(ValueError, match=r"lower_after_s \(-1"):
        ReplicaParams(lower_after_s=-1)
    with pytest.raises(ValueError, match=r"configured replicas \(0\)"):
        decide(inp(configured=0), ReplicaState(1), PARAMS)


def test_no_flapping_around_the_boundary():
    # 1700 req/s needs 2 replicas, 1750 needs 3 (2 x 861 = 1722): at 3, a rate wobbling across
    # the boundary never lowers, since a lower needs 20% to spare for 10 s
    wobble = [1700.0, 1750.0] * 30
    decisions, state = run(wobble, initial_state(3))
    assert needed(inp(arrival_rate_rps=1700.0), PARAMS) == 2
    assert needed(inp(arrival_rate_rps=1750.0), PARAMS) == 3
    assert sum(d.changed for d in decisions) == 0 and state.target == 3


def test_deterministic():
    rates = [0.0, 2000.0, 500.0, 3000.0] * 10 + [100.0] * 20
    a, sa = run(rates, initial_state(4))
    b, sb = run(rates, initial_state(4))
    assert a == b and sa == sb


def test_nonsense_rates_are_no_load():
    d, _ = decide(inp(arrival_rate_rps=float("nan")), ReplicaState(1), PARAMS)
    assert d.rule == ReplicaRule.HOLD and d.trigger_value == 0.0


def test_every_rule_answers_somewhere():
    seen = set()
    for args, st in (
        (dict(objective="latency"), ReplicaState(4)),
        (dict(arrival_rate_rps=2000.0), ReplicaState(1)),
        (dict(arrival_rate_rps=0.0, now_s=2000.0), ReplicaState(4, lower_since_s=1000.0, lower_want=1)),
        (dict(arrival_rate_rps=2000.0), ReplicaState(3)),
    ):
        d, _ = decide(inp(**args), st, PARAMS)
        seen.add(d.rule)
    assert seen == set(ReplicaRule)
    assert len(RULES) == len(ReplicaRule)


def test_lower_spell_state_carries_the_wanted_count():
    d, st = decide(inp(arrival_rate_rps=0.0), ReplicaState(4), PARAMS)
    assert st == ReplicaState(4, lower_since_s=1000.0, lower_want=1) and d.rule == ReplicaRule.HOLD
    d, st = decide(replace(inp(arrival_rate_rps=2000.0), now_s=1010.0), st, PARAMS)
    assert (d.rule, d.target) == (ReplicaRule.LOWER, 3) and st == ReplicaState(3)
