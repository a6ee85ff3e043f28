"""Open-loop arrivals: mean rate, CV, trace scaling, splits and the burst."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpubroker.sim import arrivals as arr


def _cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


def test_poisson_rate_and_cv():
    t = arr.poisson(200.0, 300.0, seed=1)
    assert isinstance(t, np.ndarray) and np.all(np.diff(t) >= 0) and t[-1] < 300.0
    assert len(t) / 300.0 == pytest.approx(200.0, rel=0.02)
    assert _cv(t) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("cv", [2.0, 4.0])
def test_gamma_rate_and_cv(cv):
    t = arr.gamma(200.0, 600.0, cv, seed=2)
    assert len(t) / 600.0 == pytest.approx(200.0, rel=0.05)
    assert _cv(t) == pytest.approx(cv, rel=0.1)


def test_same_seed_same_arrivals_and_different_seed_differs():
    assert np.array_equal(arr.poisson(50, 10, 3), arr.poisson(50, 10, 3))
    assert not np.array_equal(arr.poisson(50, 10, 3), arr.poisson(50, 10, 4))


def test_the_vendored_trace_is_in_the_repo(monkeypatch):
    monkeypatch.delenv(arr.TRACE_ENV, raising=False)
    assert arr.trace_path() == arr.DEFAULT_TRACE
    assert arr.DEFAULT_TRACE.is_relative_to(Path(arr.__file__).resolve().parent)  # inside bench/, not ../shared
    gaps, tokens = arr.load_trace()
    assert len(gaps) == len(tokens) == 8819  # every row of the code trace (row 0's gap is the mean, for wrap-around)


def test_trace_scales_to_target_rate_and_returns_context_tokens(monkeypatch):
    monkeypatch.delenv(arr.TRACE_ENV, raising=False)
    gaps, tokens = arr.load_trace()
    n = len(gaps)
    for rate in (20.0, 300.0):
        duration = 3 * n / rate  # three loops of the trace: its mean gap is exactly 1/rate
        t, tok = arr.trace(None, rate, duration, seed=5)
        assert len(t) == len(tok)
        assert np.all(np.diff(t) >= 0) and t[-1] < duration
        assert len(t) / duration == pytest.approx(rate, rel=0.02)
        assert set(np.unique(tok)) <= set(np.unique(tokens))
        assert tok.mean() == pytest.approx(tokens.mean(), rel=0.05)
    # shape preserved: the trace is far burstier than Poisson
    t, _ = arr.trace(None, 100.0, n / 100.0, seed=0)
    assert _cv(t) > 3.0


def test_trace_path_from_env(monkeypatch, tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.0,10,1\n"
        "2023-11-16 18:17:04.0,20,1\n2023-11-16 18:17:06.0,30,1\n"
    )
    monkeypatch.setenv(arr.TRACE_ENV, str(p))
    t, tok = arr.trace(None, 1.0, 30.0, seed=0)
    assert len(t) == pytest.approx(30, abs=2)
    assert set(tok) <= {10, 20, 30}
    monkeypatch.setenv(arr.TRACE_ENV, str(tmp_path / "missing.csv"))
    with pytest.raises(FileNotFoundError, match=arr.TRACE_ENV):
        arr.trace(None, 1.0, 10.0)


def test_split_rates():
    assert arr.split_rates(90, 3, "even") == [30, 30, 30]
    r = arr.split_rates(100, 3, "powerlaw")
    assert sum(r) == pytest.approx(100)
    assert r[1] / r[0] == pytest.approx(2**-0.5) and r[2] / r[0] == pytest.approx(3**-0.5)
    with pytest.raises(ValueError, match="even"):
        arr.split_rates(1, 2, "zipf")


def test_burst_one_model_five_times_others_idle():
    out = arr.burst([20.0, 20.0], busy=0, duration_s=180, start_s=60, length_s=60, seed=1)
    busy, idle = out
    during = lambda t: ((t >= 60) & (t < 120)).sum()  # noqa: E731
    assert during(busy) / 60 == pytest.approx(100.0, rel=0.1)
    assert during(idle) == 0
    assert ((idle < 60).sum()) / 60 == pytest.approx(20.0, rel=0.2)
    assert ((busy >= 120).sum()) / 60 == pytest.approx(20.0, rel=0.2)


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="rate"):
        arr.poisson(0, 10)
    with pytest.raises(ValueError, match="cv"):
        arr.gamma(1, 10, 0)
