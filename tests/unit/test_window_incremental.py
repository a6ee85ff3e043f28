"""The report window keeps its sums as reports come and go (``gpubroker.broker.control.window``): its snapshots
must equal a plain re-fold of the reports in the window, on random report streams, with the
SLO cap changing between snapshots and a fit window short enough to be trimmed.

The reference fold below is written straight from the definitions (window, rate window,
live replicas, nearest-rank percentiles, ``gpubroker.broker.control.attainment``), one report at a time."""

from __future__ import annotations

import math
import random

import pytest

import gpubroker.broker.control.window as window_module
from gpubroker.broker.control.attainment import met_and_total
from gpubroker.broker.control.decision_log import DecisionLog
from gpubroker.broker.control.latency_model import fit_latency
from gpubroker.broker.control.window import MAX_LATENCY_SAMPLES, ReportWindow, percentile
from gpubroker.broker.wire import StatsReport
from tests.unit.policy_builders import MONDAY_UTC, gpu, make_config

FIT_WINDOW = 12


def _stream(seed: int, names: list[str]):
    rng = random.Random(seed)
    t = MONDAY_UTC
    for step in range(300):
        t += rng.choice([0.1, 0.5, 0.5, 1.0, 3.0])
        reports = []
        for _ in range(rng.randint(0, 4)):
            m = rng.choice(names)
            nb = rng.randint(0, 3)
            bt = tuple((float(rng.randint(1, 32)), rng.uniform(1, 50)) for _ in range(nb))
            reports.append(
                StatsReport(
                    model=m,
                    replica_id=f"{m}-r{rng.randint(0, 2)}",
                    seq=step,
                    now_s=t,
                    interval_s=0.5,
                    arrivals=rng.randint(0, 20),
                    completions=rng.randint(0, 20),
                    rejections=rng.randint(0, 2),
                    timeouts=rng.randint(0, 1),
                    errors=rng.randint(0, 1),
                    latency_ms=tuple(rng.uniform(1, 400) for _ in range(rng.randint(0, 10))),
                    batches=bt,
                    batch_requests=tuple(int(b) for b, _ in bt),
                    busy_s=rng.uniform(0, 0.5),
                    queue_depth=rng.randint(0, 9),
                    mem_used_bytes=rng.randint(0, 10**8),
                    mem_peak_bytes=rng.randint(0, 10**8),
                    oom_costs=(float(rng.randint(1, 9)),) if rng.random() < 0.05 else (),
                    emergency_shrinks=int(rng.random() < 0.1),
                    held_refusals=rng.randint(1, 5) if rng.random() < 0.1 else 0,
                    settings_version=rng.randint(0, 5),
                )
            )
        slo = {n: rng.choice([100.0, 200.0, 250.0]) for n in names} if rng.random() < 0.3 else None
        yield t, reports, slo


def _refold(
    kept: list[tuple[float, StatsReport]], w: ReportWindow, now: float, spec, slo: float, since: float, cap: int
):
    """One model's load from the reports themselves (``cap``: latency samples kept, the newest)."""
    inside = [(t, r) for t, r in kept if t >= now - spec.control.window_s]
    rate_from, live_from = now - w.rate_window_s(), now - w.stale_after_s()
    latest = {r.replica_id: r for t, r in inside if t >= live_from}
    lat = sorted([x for _, r in inside for x in r.latency_ms][-cap:])
    paired = [(c, n) for _, r in inside for (c, _), n in zip(r.batches, r.batch_requests)]
    met = total = 0.0
    for _, r in inside:
        m, c = met_and_total(r.latency_ms, r.completions, r.rejections, r.timeouts, r.errors, slo)
        met, total = met + m, total + c
    per: dict[str, list[float]] = {}
    for t, r in inside:
        if t >= rate_from:
            acc = per.setdefault(r.replica_id, [0.0, 0.0])
            acc[0] += r.arrivals
            acc[1] += r.interval_s
    peak = {}
    for _, r in inside:
        peak[r.replica_id] = max(peak.get(r.replica_id, 0), r.mem_peak_bytes, r.mem_used_bytes)
    timings = [b for _, r in inside for b in r.batches][-FIT_WINDOW:]
    return {
        "replicas": len(latest),
        "p95_ms": percentile(lat, 95),
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "latency_samples": len(lat),
        "queue_depth": float(sum(r.queue_depth for r in latest.values())),
        "mem_used_bytes": sum(r.mem_used_bytes for r in latest.values()),
        "settings_version": min((r.settings_version for r in latest.values()), default=0),
        "cost_per_request": (sum(c for c, _ in paired) / sum(n for _, n in paired)) if paired else 1.0,
        "mean_batch": (
            sum(c for c, _ in paired) / sum(len(r.batches) for _, r in inside)
            if any(r.batches for _, r in inside)
            else 0.0
        ),
        "attainment": (met / total) if total else None,
        "arrival_rate_rps": sum(a / i for a, i in per.values() if i > 0),
        "mem_peak_bytes": sum(peak[rid] for rid in latest),
        "max_batch": max((c for _, r in inside for c, _ in r.batches), default=0.0),
        "batch_timings": tuple(timings),
        "emergency": any(r.emergency_shrinks > 0 for t, r in inside if t > since),
        "held_over": any(r.held_refusals > 0 for t, r in inside if t > since),
        "oom_costs": tuple(c for _, r in inside for c in r.oom_costs),
    }


@pytest.mark.parametrize("seed,cap", [(seed, MAX_LATENCY_SAMPLES) for seed in range(6)] + [(6, 40), (7, 40)])
def test_snapshot_equals_a_refold_of_the_window(seed, cap, monkeypatch):
    """``cap`` 40: the window often holds more samples than it keeps (the newest only), so the
    sorted samples are rebuilt rather than merged as reports come and go."""
    monkeypatch.setattr(window_module, "MAX_LATENCY_SAMPLES", cap)
    cfg = make_config(
        models={"a": {"control": {"fit_window": FIT_WINDOW}}, "b": {"control": {"fit_window": FIT_WINDOW}}}
    )
    names = list(cfg.models)
    w = ReportWindow(cfg)
    kept: dict[str, list[tuple[float, StatsReport]]] = {n: [] for n in names}
    since = float("-inf")
    checked = 0
    for t, reports, slo in _stream(seed, names):
        for r in reports:
            w.add(r, t)
            kept[r.model].append((t, r))
        if slo is None:
            continue
        snap = w.snapshot(t, gpu(), None, slo)
        for n in names:
            want = _refold(kept[n], w, t, cfg.models[n], slo[n], since, cap)
            got = snap.models[n]
            for key, value in want.items():
                have = getattr(got, key)
                if isinstance(value, float):
                    assert have == pytest.approx(value, rel=1e-9, abs=1e-9), (key, t)
                else:
                    assert have == value, (key, t)
            checked += 1
        since = t
    assert checked > 50


def test_fit_from_sums_matches_the_two_pass_fit():
    pts = [(float(b), 20 + 0.5 * b + (b % 3) * 0.1) for b in (1, 2, 4, 8, 16, 32, 64)]
    fa = fit_latency(pts)
    assert fa.a_ms == pytest.approx(20, abs=0.2) and fa.c_ms == pytest.approx(0.5, abs=0.01)
    assert fit_latency([(8.0, 18.0)] * 10).predict_ms(8) == pytest.approx(18)  # one batch size: the prior split
    assert math.isclose(fit_latency([(1, 1), (2, 50), (3, 100)]).a_ms, 0.0)


def test_decision_log_since_reads_from_the_newest_end():
    log = DecisionLog(50)
    for i in range(80):
        log.append({"kind": "note", "model": "a" if i % 2 else "b", "reason": str(i)}, str(i))
    seqs = [e["seq"] for e in log.since(since_seq=70)]
    assert seqs == sorted(seqs) and seqs[0] == 71 and seqs[-1] == log.seq
    assert all(e["model"] == "a" for e in log.since("a", since_seq=60))
    assert len(log.since()) == 50


@pytest.mark.parametrize("seed", range(4))
def test_met_and_cost_sums_equal_the_sums_over_every_report(seed):
    """``sums_met_cost`` sums only the active reports; with idle reports in between (met 0.0,
    cost 0) it must give the left-to-right float sums over every report exactly (not nearly)."""
    rng = random.Random(seed)
    mw = window_module.ModelWindow(150.0, FIT_WINDOW)
    t, checked = MONDAY_UTC, 0
    for step in range(400):
        t += 0.5
        idle = rng.random() < 0.6
        nb = 0 if idle else rng.randint(0, 3)
        bt = tuple((float(rng.randint(1, 16)), rng.uniform(1, 80)) for _ in range(nb))
        lat = () if idle else tuple(rng.uniform(1, 300) for _ in range(rng.randint(0, 6)))
        r = StatsReport(
            model="a",
            replica_id="r0",
            seq=step,
            now_s=t,
            interval_s=0.5,
            arrivals=0 if idle else rng.randint(0, 9),
            completions=len(lat),
            latency_ms=lat,
            batches=bt,
            batch_requests=tuple(int(b) for b, _ in bt),
        )
        mw.add(window_module.Digest(t, r, 150.0))
        if rng.random() < 0.5:
            mw.evict(t - rng.choice([2.0, 10.0, 30.0]))
        got = mw.sums_met_cost()
        want = (sum(d.met for d in mw.events), sum(d.cost for d in mw.events))
        assert got == want, (step, got, want)
        checked += any(d.active for d in mw.events) and not all(d.active for d in mw.events)
    assert checked > 100  # windows that mix idle and active reports


@pytest.mark.parametrize("seed", range(3))
def test_sums_and_latencies_stay_exact_over_a_long_window_and_a_cap_change(seed):
    """A 120-s window of mostly active reports: the met/cost values kept as arrays are cut off in
    bulk once enough have left (``vals_head``), and the SLO cap changes after such a cut; the sums
    still equal the left-to-right sums over the window's digests, and the sorted latencies the
    sorted samples of the window."""
    rng = random.Random(seed)
    mw = window_module.ModelWindow(150.0, FIT_WINDOW)
    t, cuts, slo = MONDAY_UTC, 0, 150.0
    for step in range(1200):
        t += 0.5
        lat = tuple(round(rng.uniform(1, 300), 1) for _ in range(rng.randint(0, 6)))
        bt = tuple((float(rng.randint(1, 16)), rng.uniform(1, 80)) for _ in range(rng.randint(0, 2)))
        r = StatsReport(
            model="a",
            replica_id=f"r{step % 3}",
            seq=step,
            now_s=t,
            interval_s=0.5,
            arrivals=rng.randint(0, 9),
            completions=len(lat),
            latency_ms=lat,
            batches=bt,
            batch_requests=tuple(int(b) for b, _ in bt),
        )
        mw.add(window_module.Digest(t, r, mw.slo_ms))
        head = mw.vals_head
        mw.evict(t - 120.0)
        cuts += mw.vals_head < head
        if step % 400 == 350:  # at 350, before any cut (the first comes near 480), and at 750 and 1150, after cuts
            slo = rng.choice([40.0, 150.0, 260.0])
            mw.recount(slo)
        got = mw.sums_met_cost()
        want = (sum(d.met for d in mw.events), sum(d.cost for d in mw.events))
        assert got == want, (step, got, want)
        assert list(mw.latencies()) == sorted(v for d in mw.events for v in d.lat), step
    assert cuts >= 2  # the bulk cut ran, and sums after it were checked
