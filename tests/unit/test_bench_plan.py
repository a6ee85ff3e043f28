"""How the live benchmark plans its runs and reports them (pure parts; no Ray).

- knee runs size their window by the rate, and every arm of a comparison sees the same
  arrivals in its measured window whatever its warm-up;
- every arm runs under the same deadline (``ArmRules``), BentoML included.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.live_runs import Opts, knee_arrivals, run_length
from gpubroker.sim import arrivals as arr


def test_window_holds_min_requests_within_bounds():
    o = Opts()
    for rate in (1.0, 5.0, 12.0, 30.0, 300.0):
        warm, dur = run_length(o, rate, adaptive=True)
        window = dur - warm - o.cooldown_s
        assert o.min_window_s <= window <= o.max_window_s
        if o.min_requests / rate <= o.max_window_s:  # not capped: enough requests
            assert rate * window >= o.min_requests - 1e-9
    # a static arm warms up for less, the broker (or BentoML) for o.warmup_s
    assert run_length(o, 10.0, adaptive=False)[0] < run_length(o, 10.0, adaptive=True)[0] == o.warmup_s


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("arrivals", ["poisson", "gamma:2"])
@pytest.mark.parametrize("rate", [4.7, 17.8, 57.6, 64.0, 70.7])
def test_a_knee_window_offers_its_nominal_rate_on_every_seed(rate, arrivals, quick):
    """The held knee compares seeds at one rate; with a plain draw one seed's 8-s window offered
    1.08-1.10x the profiled knee's rates (MiniLM's 0.85-1.16x): the seeds differed in load."""
    o = Opts.make(quick=quick, arrivals=arrivals)
    o.seeds = (0, 1, 2, 3, 4)
    for seed in o.seeds:
        for adaptive in (True, False):
            t, warm, dur = knee_arrivals(o, rate, seed, adaptive=adaptive)
            window = dur - warm - o.cooldown_s
            n = np.count_nonzero((t >= warm) & (t < dur - o.cooldown_s))
            assert abs(n - rate * window) <= 0.5 + 1e-9, (seed, adaptive, n, rate * window)
            assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < dur  # sorted, inside the run


def test_the_plain_window_is_kept_for_side_by_side_runs_and_was_off_its_rate():
    o, rate = Opts.make(quick=False), 17.8
    _, warm, dur = knee_arrivals(o, rate, 2, adaptive=True)
    plain = arr.poisson(rate, dur, 2)
    n = np.count_nonzero((plain >= warm) & (plain < dur - o.cooldown_s))
    assert n / (rate * (dur - warm - o.cooldown_s)) > 1.05  # seed 2 offered 10 % more
    o.exact_window = False  # knee_breakdown --plain-window
    t, *_ = knee_arrivals(o, rate, 2, adaptive=True)
    assert np.array_equal(t, plain)


def test_exact_count_spacing_and_errors():
    t = arr.exact_count(50.0, 100.0, seed=3)
    assert len(t) == 5000 and np.all(np.diff(t) >= 0) and 0 <= t[0] and t[-1] < 100.0
    gaps = np.diff(t)
    assert 0.9 < gaps.std() / gaps.mean() < 1.1  # Poisson-like: CV 1
    g = np.diff(arr.exact_count(50.0, 100.0, seed=3, cv=2.0))
    assert 1.7 < g.std() / g.mean() < 2.3  # the gamma draw keeps its burstiness
    assert np.array_equal(arr.exact_count(50.0, 100.0, seed=3), t)  # a seed is one draw
    assert len(arr.exact_count(0.01, 10.0, seed=0)) == 0
    with pytest.raises(ValueError, match="cv"):
        arr.exact_count(5.0, 1.0, cv=0.0)
    with pytest.raises(ValueError, match="rate"):
        arr.exact_count(0.0, 1.0)


@pytest.mark.parametrize("rate", [4.6, 33.0, 61.0])
def test_static_and_adaptive_arms_measure_the_same_arrivals(rate):
    o = Opts.make(quick=False)
    t_s, warm_s, dur_s = knee_arrivals(o, rate, seed=1, adaptive=False)
    t_a, warm_a, dur_a = knee_arrivals(o, rate, seed=1, adaptive=True)
    assert warm_s < warm_a
    win_s = t_s[(t_s >= warm_s) & (t_s < dur_s - o.cooldown_s)] - warm_s
    win_a = t_a[(t_a >= warm_a) & (t_a < dur_a - o.cooldown_s)] - warm_a
    assert len(win_a) > 50
    np.testing.assert_allclose(win_s, win_a, atol=1e-9)
    # a different seed is a different schedule
    t_b, _, _ = knee_arrivals(o, rate, seed=2, adaptive=True)
    assert len(t_b) != len(t_a) or not np.allclose(t_b, t_a)


def test_arrivals_option_is_checked_and_gamma_is_burstier():
    from bench.live_runs import draw_arrivals, parse_arrivals

    assert parse_arrivals("poisson") is None and parse_arrivals("gamma:4") == 4.0
    for bad in ("gamma", "gamma:0", "gamma:x", "uniform"):
        with pytest.raises(ValueError, match="gamma:CV"):
            parse_arrivals(bad)
    cv = lambda t: float(np.std(np.diff(t)) / np.mean(np.diff(t)))  # noqa: E731
    assert cv(draw_arrivals("gamma:4", 50.0, 600.0, 0)) > 2.5 > 1.3 > cv(draw_arrivals("poisson", 50.0, 600.0, 0))
    o = Opts(arrivals="gamma:2")
    t, _, _ = knee_arrivals(o, 20.0, 0, adaptive=True)
    assert cv(t) > 1.4


def test_every_arm_gets_the_same_deadline_and_none_sheds():
    from bench.live_runs import peer_max_latency_ms, profiled_workload, timeouts
    from gpubroker.sim.knee import ArmRules

    w, cap = profiled_workload(10.0), 600.0
    rules = Opts.make(False).rules
    broker, static = w.spec(cap, rules), w.static_spec(cap, 8, 100.0, rules)
    deadline_s = timeouts(cap, rules)[0]
    assert broker["request_timeout_s"] == static["request_timeout_s"] == deadline_s == pytest.approx(3.0)
    assert not broker["shed_late"] and not static["shed_late"]
    assert peer_max_latency_ms(cap, rules) == pytest.approx(1000 * deadline_s)  # BentoML: no refusal at the cap
    assert peer_max_latency_ms(cap, ArmRules(shed=True)) == cap
    with pytest.raises(ValueError, match="ArmRules.shed"):
        w.static_spec(cap, 8, 100.0, ArmRules(shed=True))
