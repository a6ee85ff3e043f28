"""One rule for every arm (BENCHMARK.md): a late answer is a miss, and each knee records the
deadline, the shedding rule and the search it ran under."""

from __future__ import annotations

import pytest

from gpubroker.sim.knee import ArmRules, OracleGrid, RunSettings, Search, evaluate, knee, oracle, run_at, with_cap
from gpubroker.sim.types import ModelResult, SimResult
from tests.sim.conftest import fleet, profiled


def _result(offered: int, completed: int, good: int, p95_ms: float) -> SimResult:
    m = ModelResult(
        model="prof",
        cap_ms=50.0,
        offered=offered,
        offered_rps=offered / 60,
        completed=completed,
        completed_rps=completed / 60,
        attainment=good / offered,
        goodput_rps=good / 60,
        p50_ms=20.0,
        p95_ms=p95_ms,
        p99_ms=p95_ms,
        mean_batch=4.0,
        mean_batch_cost=4.0,
        batches=offered // 4,
        ooms=0,
        rejects=0,
        timeouts=0,
        errors=0,
        unfinished=offered - completed,
        oversize=0,
        mem_peak_bytes=0,
    )
    return SimResult("static:8:10", 60.0, 10.0, 0, {"prof": m}, {})


def test_a_late_answer_is_a_miss():
    # every request answered (completed/offered = 1) and P95 under the cap, but 3 % answered late:
    # the old rule (P95 ≤ cap, completed/offered ≥ 0.99) passed this; attainment 0.97 fails it
    ok, why = evaluate(_result(1000, 1000, 970, 49.0))
    assert not ok and "attainment 0.9700 < 0.99" in why
    assert evaluate(_result(1000, 1000, 995, 49.0))[0]
    assert not evaluate(_result(1000, 980, 980, 30.0))[0]  # unanswered requests are misses too


def test_rules_set_the_same_deadline_and_shedding_on_every_model():
    cfg = with_cap(fleet({"a": profiled(20, 0.5, slo_ms=50), "b": profiled(10, 2, slo_ms=80)}), {"a": 60.0})
    ruled = ArmRules(deadline_caps=4.0).apply(cfg)
    assert ruled.models["a"].request_timeout_s == pytest.approx(0.24)
    assert ruled.models["b"].request_timeout_s == pytest.approx(0.32)
    assert not any(s.shed_late for s in ruled.models.values())
    assert all(s.shed_late for s in ArmRules(shed=True).apply(cfg).models.values())


def test_an_arm_that_cannot_shed_refuses_a_shedding_rule():
    cfg = fleet({"prof": profiled(20, 0.5, slo_ms=60)})
    with pytest.raises(ValueError, match="ArmRules.shed"):
        run_at(cfg, "static:8:10", 50.0, RunSettings(duration_s=5.0, warmup_s=1.0), ArmRules(shed=True))


def test_every_arm_records_the_same_rules_and_search():
    cfg = fleet({"prof": profiled(20, 0.5, slo_ms=60)})
    rs = RunSettings(duration_s=20.0, warmup_s=5.0)
    rules, search = ArmRules(deadline_caps=3.0), Search(step=1.2, bisect_iters=1)
    docs = [knee(cfg, arm, 40.0, rs, rules=rules, search=search).to_dict() for arm in ("static:8:10", "broker")]
    assert docs[0]["rules"] == docs[1]["rules"] == rules.to_dict()
    assert docs[0]["search"] == docs[1]["search"] == {"step": 1.2, "bisect_iters": 1, "max_runs": None}
    assert rules.to_dict()["late_answer"] == "miss" and rules.to_dict()["deadline_caps"] == 3.0


def test_the_oracle_grid_holds_gated_static_settings():
    cfg = fleet({"prof": profiled(20, 0.5, slo_ms=60)})
    rs = RunSettings(duration_s=20.0, warmup_s=5.0)
    _, arm, arms = oracle(
        cfg, 40.0, rs, grid=OracleGrid(batches=(32,), waits_ms=(10.0,)), search=Search(bisect_iters=1)
    )
    assert [a["arm"] for a in arms] == ["static:32:10", "static:32:10:gate"]
    assert arm == "static:32:10:gate"  # the lazy gate forms fuller batches: it wins here
