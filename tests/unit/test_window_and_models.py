"""Report window folding, the latency fit, the memory model and profile selection."""

from __future__ import annotations

import pytest

from gpubroker.broker.control.latency_model import LatencyFit, fit_latency
from gpubroker.broker.control.memory_model import MemoryModel
from gpubroker.broker.control.profiles import active_profile
from gpubroker.broker.control.window import ReportWindow, percentile
from gpubroker.broker.wire import StatsReport
from tests.unit.policy_builders import MONDAY_UTC, MiB, gpu, make_config


def test_fit_recovers_a_and_c():
    pts = [(b, 20 + 0.5 * b) for b in (1, 2, 4, 8, 16, 32, 64)]
    fit = fit_latency(pts)
    assert fit.a_ms == pytest.approx(20, rel=1e-6) and fit.c_ms == pytest.approx(0.5, rel=1e-6)
    assert fit.largest_batch_within(52 / 2) == pytest.approx(12)


def test_fit_is_clamped_on_noise():
    fit = fit_latency([(2, 30), (4, 20), (8, 10)])  # negative slope
    assert fit.c_ms > 0 and fit.a_ms >= 0
    fit = fit_latency([(1, 1), (2, 50), (3, 100)])  # negative intercept
    assert fit.a_ms == 0 and fit.c_ms > 0


def test_fit_keeps_prior_when_batch_never_varies():
    prior = LatencyFit(10, 1, 50)
    assert fit_latency([(8, 18)] * 10, prior) is prior
    fresh = fit_latency([(8, 18)] * 10)
    assert fresh.predict_ms(8) == pytest.approx(18)


def test_memory_model_cap():
    mm = MemoryModel(weights_bytes=100 * MiB, bytes_per_unit=10 * MiB)
    assert mm.cap_for(1000 * MiB) == 80  # (900 - 100) / 10
    assert mm.cap_for(50 * MiB) == 0
    assert MemoryModel(0, 0).cap_for(1) is None
    assert mm.cap_for(mm.grant_for(40)) >= 40


def test_percentile_nearest_rank():
    vals = sorted(float(i) for i in range(1, 101))
    assert percentile(vals, 95) == 95.0
    assert percentile(vals, 50) == 50.0
    assert percentile([], 95) is None


def _report(replica, t, **kw):
    base = dict(model="a", replica_id=replica, seq=0, now_s=t, interval_s=0.5)
    base.update(kw)
    return StatsReport(**base)


def test_window_folds_replicas():
    cfg = make_config()
    w = ReportWindow(cfg)
    t0 = MONDAY_UTC
    for i in range(10):
        t = t0 + i * 0.5
        w.add(
            _report(
                "r1",
                t,
                arrivals=10,
                completions=10,
                latency_ms=tuple(float(x) for x in range(10)),
                queue_depth=3,
                batches=((5.0, 25.0), (5.0, 26.0)),
                batch_requests=(5, 5),
                busy_s=0.25,
                mem_used_bytes=100,
                mem_peak_bytes=150,
            ),
            t,
        )
        w.add(
            _report(
                "r2",
                t,
                arrivals=20,
                completions=20,
                latency_ms=(200.0,) * 20,
                queue_depth=4,
                mem_used_bytes=200,
                emergency_shrinks=1 if i == 9 else 0,
            ),
            t,
        )
    snap = w.snapshot(t0 + 5.0, gpu())
    a = snap.models["a"]
    assert a.replicas == 2
    assert a.queue_depth == 7
    assert a.arrival_rate_rps == pytest.approx(60, rel=0.01)  # 10/0.5 + 20/0.5
    assert a.latency_samples == 300
    assert a.p95_ms == 200.0 and a.p50_ms == 200.0
    assert a.mean_batch == 5.0
    assert a.busy_frac == pytest.approx(0.25)  # (0.5 + 0) / 2 replicas
    assert a.mem_used_bytes == 300
    assert a.emergency is True
    assert a.attainment == pytest.approx(100 / 300)  # slo 100 ms: r2's 200 ms samples miss
    # the emergency is reported once, not on every later tick
    assert w.snapshot(t0 + 5.5, gpu()).models["a"].emergency is False


def test_window_drops_stale_replicas_and_old_samples():
    cfg = make_config()
    w = ReportWindow(cfg)
    w.add(_report("r1", MONDAY_UTC, latency_ms=(10.0,), queue_depth=5), MONDAY_UTC)
    snap = w.snapshot(MONDAY_UTC + 60, gpu())
    assert snap.models["a"].replicas == 0 and snap.models["a"].queue_depth == 0
    assert snap.models["a"].latency_samples == 0


def test_window_ignores_unknown_model():
    w = ReportWindow(make_config())
    assert w.add(StatsReport(model="zzz", replica_id="r", seq=0, now_s=0, interval_s=1), 0) is False


def test_report_dict_round_trip():
    r = _report("r1", 1.0, latency_ms=(1.0, 2.0), batches=((2.0, 3.0),), batch_requests=(2,))
    assert StatsReport.from_dict(r.to_dict()) == r


def test_profile_default_outside_windows():
    cfg = make_config(
        profiles={
            "timezone": "Europe/Berlin",
            "schedule": [
                {"name": "peak", "days": "mon-fri", "hours": "08:00-20:00"},
                {"name": "off", "default": True},
            ],
        }
    )
    # Monday 07:30 UTC = 08:30 in Berlin (CET, UTC+1)
    assert active_profile(cfg.profiles, MONDAY_UTC + 7.5 * 3600).name == "peak"
    assert active_profile(cfg.profiles, MONDAY_UTC + 6.5 * 3600).name == "off"
    assert active_profile(cfg.profiles, MONDAY_UTC + 5 * 86400 + 10 * 3600).name == "off"  # Saturday


def test_memory_model_refined_from_live_peak():
    from gpubroker.broker.control.types import ModelLoad

    calibrated = ModelLoad(
        name="a", replicas=1, weights_bytes=16 * MiB, bytes_per_unit=4 * MiB, mean_batch=2.0, mem_peak_bytes=20 * MiB
    )
    assert MemoryModel.from_load(calibrated).weights_bytes == 16 * MiB  # peak explained by weights + batch
    grown = ModelLoad(
        name="a",
        replicas=1,
        weights_bytes=16 * MiB,
        bytes_per_unit=4 * MiB,
        mean_batch=1.5,
        batch_timings=((1.0, 300.0), (2.0, 305.0)),
        mem_peak_bytes=80 * MiB,
    )
    mm = MemoryModel.from_load(grown)
    assert mm.weights_bytes == 72 * MiB  # 80 peak - the biggest batch's 2 x 4
    assert mm.cap_for(64 * MiB) == 0  # a 64 MiB grant holds no batch: the model must borrow
    assert MemoryModel.from_load(ModelLoad(name="a", mem_peak_bytes=80 * MiB)).calibrated is False
