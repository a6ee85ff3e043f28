"""bench.live_seed.hold: a live knee is reported as the rate every seed passes, seed 0's beside it."""

from __future__ import annotations

from bench.live_runs import Opts
from bench.live_seed import hold
from bench.scenarios_report import held_cell
from gpubroker.sim.knee import HOLD_RUNS_PER_SEED


class FakeRun:
    def __init__(self, rate: float, seed: int, limit: float):
        self.rate, self.seed, self.passes = rate, seed, rate <= limit

    def row(self) -> dict:
        m = {"p95_ms": 1.0, "cap_ms": 2.0, "attainment": 1.0, "mean_batch": 2.0, "send_lag_p99_ms": 1.0}
        return {"rate": self.rate, "seed": self.seed, "pass": self.passes, "models": {"prof": m}}


def test_hold_reports_the_knee_every_seed_passes_and_keeps_seed0():
    limits = {0: 60.0, 1: 58.0, 2: 52.0}
    o = Opts(seeds=(0, 1, 2), log=lambda _m: None)
    doc = {"knee_rps": 60.0, "rows": []}
    held = hold(doc, lambda r, s: FakeRun(r, s, limits[s]), o, "broker")
    assert doc["seed0_knee_rps"] == 60.0 and doc["knee_rps"] == held
    assert 52.0 * 0.95 < held <= 52.0
    assert {r["seed"] for r in doc["seeds_at_knee"]} == {0, 1, 2}


def test_one_seed_keeps_the_knee():
    doc = {"knee_rps": 10.0, "rows": []}
    assert hold(doc, lambda r, s: FakeRun(r, s, 0.0), Opts(seeds=(0,), log=lambda _m: None), "x") == 10.0
    assert doc["seed0_knee_rps"] == 10.0 and "seeds_at_knee" not in doc


def test_a_hold_the_budget_stops_is_not_held_rather_than_a_knee_of_zero():
    """knee_rps None (not 0) with the rate it stopped under; the report and the log say so."""
    lines: list[str] = []
    o = Opts(seeds=(0, 1, 2), log=lines.append)
    doc = {"knee_rps": 40.0, "rows": []}
    assert hold(doc, lambda r, s: FakeRun(r, s, 1.0 if s == 2 else 99.0), o, "broker") is None
    assert doc["knee_rps"] is None and doc["held_resolved"] is False and doc["seed0_knee_rps"] == 40.0
    assert len(doc["seeds_at_knee"]) == HOLD_RUNS_PER_SEED * 3 and doc["held_below_rps"] < 40.0
    assert f"not held within {HOLD_RUNS_PER_SEED * 3} runs" in lines[-1]
    assert held_cell(doc).startswith("**not held** above")
    held = {"knee_rps": 40.0, "rows": []}
    assert hold(held, lambda r, s: FakeRun(r, s, 99.0), o, "broker") == 40.0
    assert held["held_resolved"] is True and held_cell(held).startswith("**40.0/s**")
