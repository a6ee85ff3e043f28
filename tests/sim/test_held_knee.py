"""Knees that hold on every seed (gpubroker.sim.knee.held_search) and the gated static arm of the ablation."""

from __future__ import annotations

import pytest

from gpubroker.sim.knee import held_search
from gpubroker.sim.types import Arm, parse_arm


def test_held_knee_is_where_every_seed_passes():
    limits = {0: 100.0, 1: 90.0, 2: 80.0}  # seed -> the largest rate it passes
    calls: list[tuple[float, int]] = []

    def passes(rate: float, seed: int) -> bool:
        calls.append((rate, seed))
        return rate <= limits[seed]

    held = held_search(passes, 100.0, (0, 1, 2), step=0.95).rate
    assert held <= 80.0 and held > 80.0 * 0.95  # the first 5 % step under the weakest seed
    assert (100.0, 0) not in calls  # seed 0 passes at its own knee: not re-run there
    assert all(passes(held, s) for s in (0, 1, 2))


def test_held_knee_equals_seed0_when_all_seeds_pass_and_respects_the_budget():
    assert held_search(lambda r, s: True, 50.0, (0, 1, 2)).rate == 50.0
    assert held_search(lambda r, s: s == 0, 50.0, (0, 1, 2), max_runs=5).rate == 0.0
    assert held_search(lambda r, s: True, 0.0, (0, 1, 2)).rate == 0.0


def test_a_search_the_budget_stops_is_unresolved_not_a_knee_of_zero():
    limits = {0: 100.0, 1: 100.0, 2: 60.0}
    held = held_search(lambda r, s: r <= limits[s], 100.0, (0, 1, 2), step=0.95, max_runs=6)
    assert not held.resolved and held.rate == 0.0 and held.runs == 6
    assert 60.0 < held.below_rps < 100.0  # still stepping down: nothing above it held
    done = held_search(lambda r, s: r <= limits[s], 100.0, (0, 1, 2), step=0.95)
    assert done.resolved and done.below_rps is None and 57.0 < done.rate <= 60.0


def test_gated_static_arm_parses_and_labels():
    assert parse_arm("static:32:10:gate") == Arm("static", 32, 10.0, True)
    assert parse_arm("static:32:10:gate").label == "static:32:10:gate"
    assert parse_arm("static:32:10") == Arm("static", 32, 10.0, False)
    with pytest.raises(ValueError):
        parse_arm("static:32:10:lazy")


def test_the_gate_makes_a_static_arm_form_bigger_batches():
    from gpubroker.quotas.config import load_config
    from gpubroker.sim.engine import SimOptions, run_sim

    cfg = load_config("configs/sim-a20-c0.5.yaml")
    eager = run_sim(cfg, "static:32:10", {"prof": 200.0}, 60.0, opts=SimOptions(warmup_s=15.0)).models["prof"]
    gated = run_sim(cfg, "static:32:10:gate", {"prof": 200.0}, 60.0, opts=SimOptions(warmup_s=15.0)).models["prof"]
    assert gated.mean_batch > 2 * eager.mean_batch  # eager closes a batch 10 ms after its first request
    assert gated.completed >= eager.completed


def test_held_knee_bisects_between_the_held_rate_and_the_failed_one():
    limits = {0: 100.0, 1: 100.0, 2: 93.0}  # seed 2 fails at 95, holds at 90.25; its edge is 93
    calls: list[tuple[float, int]] = []

    def passes(rate: float, seed: int) -> bool:
        calls.append((rate, seed))
        return rate <= limits[seed]

    plain = held_search(passes, 100.0, (0, 1, 2), step=0.95)
    assert plain.rate == pytest.approx(90.25)
    calls.clear()
    one = held_search(passes, 100.0, (0, 1, 2), step=0.95, bisect_iters=1)
    assert one.resolved and one.rate == pytest.approx((90.25 + 95.0) / 2)  # 92.6: every seed passed
    mid_calls = [c for c in calls if c[0] == pytest.approx(92.625)]
    assert [s for _, s in mid_calls] == [2, 0, 1]  # the seed that failed last runs first
    two = held_search(passes, 100.0, (0, 1, 2), step=0.95, bisect_iters=2)
    assert two.rate == pytest.approx(92.625)  # 93.8 failed on seed 2: the held rate stays
    assert all(passes(two.rate, s) for s in (0, 1, 2))


def test_held_bisection_skips_when_seed0_knee_holds_and_stops_at_the_budget():
    assert held_search(lambda r, s: True, 50.0, (0, 1, 2), bisect_iters=3).runs == 2  # nothing failed above
    limits = {0: 100.0, 1: 100.0, 2: 93.0}
    cut = held_search(lambda r, s: r <= limits[s], 100.0, (0, 1, 2), step=0.95, bisect_iters=1, max_runs=7)
    # 2 runs at 100 (seed 2 fails), 1 at 95, 3 at 90.25 (held); the midpoint gets one run of three
    assert cut.resolved and cut.rate == pytest.approx(90.25)
