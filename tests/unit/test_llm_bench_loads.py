"""The LLM benchmark's loads and its gains (bench/llm_bench.py): pure, no engine runs here."""

from __future__ import annotations

import pytest

from bench import llm_bench as lb


def test_bursty_load_has_each_engine_burst_in_its_own_phase_while_the_others_idle():
    loads = lb.loads_for("bursty", lb.ENGINES, 10.0, 50.0, 0.5, seed=0)
    assert set(loads) == set(lb.ENGINES)
    for i, name in enumerate(lb.ENGINES):
        times = [r.t_s for r in loads[name]]
        assert times == sorted(times) and 0.0 <= times[0] and times[-1] < 10.0 * len(lb.ENGINES)
        own = sum(1 for t in times if i * 10.0 <= t < (i + 1) * 10.0)
        assert own >= 0.8 * 50.0 * 10.0 and len(times) - own <= 20  # its burst; a trickle in the others'


def test_independent_load_gives_every_engine_the_steady_rate_on_its_own_draws():
    loads = lb.loads_for("independent", lb.ENGINES, 10.0, 50.0, 0.5, seed=0)
    total = 10.0 * len(lb.ENGINES)
    for reqs in loads.values():
        assert len(reqs) == pytest.approx(lb.INDEPENDENT_RPS * total, rel=0.2)
    assert len({tuple(r.t_s for r in reqs[:5]) for reqs in loads.values()}) == len(lb.ENGINES)


def test_gains_are_the_broker_over_each_other_arm_and_the_worst_seed():
    def run(load, seed, static, fixed, broker):
        arms = [
            {"arm": a, "goodput_rps": g}
            for a, g in zip(("static-split", "broker-fixed", "broker"), (static, fixed, broker))
        ]
        return {"load": load, "seed": seed, "arms": arms}

    g = lb.gains(
        [
            run("bursty", 0, 60.0, 65.0, 90.0),
            run("bursty", 1, 70.0, 60.0, 84.0),
            run("independent", 0, 50.0, 50.0, 49.0),
        ]
    )
    assert g["bursty"]["per_seed"][0] == {"seed": 0, "over_static": 1.5, "over_fixed": 1.385}
    assert g["bursty"]["worst"] == 1.2 and g["independent"]["worst"] == 0.98


def test_a_quota_move_row_is_timed_from_the_arm_start_and_names_both_ends():
    entry = {"kind": "move", "time_s": 1012.3, "move": "reclaim", "donor": "b", "recipient": "a", "amount_bytes": 5}
    row = lb.move_row(entry | {"reason": "a load back", "dry_run": False}, 1000.0)
    assert row == {
        "t_s": 12.3,
        "move": "reclaim",
        "donor": "b",
        "recipient": "a",
        "amount_bytes": 5,
        "reason": "a load back",
    }
