"""Summary maths of the open-loop load generator (no network, no timing assertions)."""

import json

import pytest

from bench import loadgen as lg
from bench.loadgen import Record


def rec(i, t, status=200, lat_ms=10.0, model="m", batch=None, cost=None, bms=None, err=None):
    r = Record(i, model, t, send_s=t, finish_s=t + lat_ms / 1000.0, status=status, latency_ms=lat_ms, error=err)
    r.batch, r.batch_cost, r.batch_ms = batch, cost, bms
    return r


def test_percentile_nearest_rank():
    assert lg.percentile([], 95) is None
    vals = list(range(1, 101))
    assert lg.percentile(vals, 50) == 50
    assert lg.percentile(vals, 95) == 95
    assert lg.percentile(vals, 99) == 99
    assert lg.percentile([7.0], 99) == 7.0
    assert lg.percentile([3, 1, 2], 100) == 3


def test_summary_counts_misses_and_trims_window():
    recs = [rec(0, 0.5, lat_ms=1.0)]  # in warm-up: ignored
    recs += [rec(i, 1.0 + i * 0.1, lat_ms=20.0) for i in range(1, 81)]  # 80 fast
    recs += [rec(100 + i, 2.0 + i * 0.1, lat_ms=200.0) for i in range(10)]  # 10 over the cap
    recs += [rec(200 + i, 3.0 + i * 0.1, status=503) for i in range(5)]
    recs += [rec(300 + i, 4.0 + i * 0.1, status=504) for i in range(3)]
    recs += [rec(400, 5.0, status=0, err="client timeout after 5s"), rec(401, 5.1, status=0, err="ConnectionReset")]
    recs += [rec(500, 9.95, lat_ms=1.0)]  # in cool-down: ignored
    s = lg.summarize(recs, duration_s=10.0, caps_ms={"m": 100.0}, warmup_s=1.0, cooldown_s=0.5)["m"]
    assert s.offered == 80 + 10 + 5 + 3 + 2
    assert s.completed == 90
    assert s.good == 80
    assert (s.rejections, s.timeouts, s.errors) == (5, 4, 1)
    assert s.window_s == pytest.approx(8.5)
    assert s.offered_rps == pytest.approx(100 / 8.5)
    assert s.goodput_rps == pytest.approx(80 / 8.5)
    assert s.attainment == pytest.approx(0.8)  # drops, rejections and timeouts are misses
    assert s.p50_ms == 20.0 and s.p99_ms == 200.0
    assert s.passes is False  # completed/offered 0.9 < 0.99


def test_passes_needs_p95_and_completion():
    ok = [rec(i, 1 + i * 0.01, lat_ms=10.0) for i in range(200)]
    s = lg.summarize(ok, 10.0, 50.0, warmup_s=1.0)["m"]
    assert s.passes is True and s.attainment == 1.0
    slow = ok[:180] + [rec(1000 + i, 5 + i * 0.01, lat_ms=80.0) for i in range(20)]
    assert lg.summarize(slow, 10.0, 50.0, warmup_s=1.0)["m"].passes is False  # P95 over the cap
    one_drop = ok[:197] + [rec(2000 + i, 6 + i * 0.01, status=503) for i in range(3)]
    assert lg.summarize(one_drop, 10.0, 50.0, warmup_s=1.0)["m"].passes is False  # 197/200 < 0.99
    assert lg.all_pass({"m": lg.summarize(ok, 10.0, 50.0)["m"]})


def test_a_late_200_is_a_miss():
    # 3 of 200 answered 200 but after the cap: P95 under the cap and every request answered, which
    # the old rule passed; attainment 197/200 < 0.99 fails it, as it would three refusals
    late = [rec(i, 1 + i * 0.01, lat_ms=10.0) for i in range(197)] + [
        rec(3000 + i, 6 + i * 0.01, lat_ms=80.0) for i in range(3)
    ]
    s = lg.summarize(late, 10.0, 50.0, warmup_s=1.0)["m"]
    assert s.completed == s.offered == 200 and s.p95_ms is not None and s.p95_ms <= 50.0
    assert s.attainment == pytest.approx(0.985) and s.passes is False


def test_no_cap_means_every_completion_is_good():
    s = lg.summarize([rec(0, 0.1, lat_ms=1e6)], 1.0)["m"]
    assert s.good == 1 and s.passes is None


def test_throughput_counts_by_finish_time():
    recs = [rec(i, 0.1 * i, lat_ms=3000.0) for i in range(50)]  # scheduled 0..4.9 s, finish 3..7.9 s
    s = lg.summarize(recs, 5.0, None)["m"]
    assert s.completed == 50
    assert s.throughput_rps == pytest.approx(20 / 5.0)  # only those finishing before 5 s


def test_per_model_and_seeds_table():
    recs = [rec(i, 0.1 * i, model="a") for i in range(10)] + [
        rec(10 + i, 0.1 * i, model="b", status=503) for i in range(10)
    ]
    s = lg.summarize(recs, 1.0, {"a": 100.0, "b": 100.0})
    assert set(s) == {"a", "b"} and s["b"].attainment == 0.0 and s["b"].p95_ms is None
    t = lg.seeds_table([s, s])
    assert t["a"]["attainment"]["mean"] == 1.0 and t["b"]["rejections"] == 20 and not t["b"]["passes_all"]
    assert lg.total_goodput(s) == pytest.approx(10.0)


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="warmup_s"):
        lg.summarize([], 5.0, None, warmup_s=4.0, cooldown_s=2.0)


def test_batch_stats_fit_recovers_line():
    recs = []
    i = 0
    for b in (1, 2, 4, 8, 16, 32):
        for _ in range(b):
            recs.append(rec(i, 0.01 * i, batch=b, cost=b, bms=20.0 + 0.5 * b))
            i += 1
    st = lg.batch_stats(recs, "m")
    assert st["fit_a_ms"] == pytest.approx(20.0, abs=1e-6) and st["fit_c_ms"] == pytest.approx(0.5, abs=1e-6)
    assert st["fit_batches"] == 6
    assert st["mean_batch"] == pytest.approx(sum(b * b for b in (1, 2, 4, 8, 16, 32)) / 63)  # request-weighted
    assert lg.batch_stats([], "m")["mean_batch"] is None


def test_read_tags_fleet_and_bentoml_bodies():
    r = Record(0, "m", 0.0)
    lg._read_tags(r, json.dumps({"outputs": [{"_batch": 4, "_cost": 4, "_batch_ms": 22.0}], "latency_ms": 30}).encode())
    assert (r.batch, r.batch_cost, r.batch_ms, r.server_ms) == (4, 4, 22.0, 30)
    r2 = Record(1, "m", 0.0)
    lg._read_tags(r2, json.dumps([{"_batch": 2, "_cost": 2, "_batch_ms": 21.0}]).encode())
    assert r2.batch == 2
    lg._read_tags(r2, b"not json")  # ignored


def test_plan_and_merge_keep_order_and_bodies():
    a = lg.plan("a", [0.0, 0.2], b"A")
    b = lg.plan("b", [0.1], lambda t: f"{t}".encode(), tokens=[7])
    m = lg.merge(a, b)
    assert [p.model for p in m] == ["a", "b", "a"] and m[1].body == b"7" and m[1].tokens == 7
    assert json.loads(lg.default_body("profiled", 5)) == {"inputs": [{"tokens": 5}]}
    assert json.loads(lg.default_body("profiled")) == {"inputs": [{}]}
    assert len(json.loads(lg.default_body("minilm", 12))["inputs"][0]["text"].split()) == 10


def test_settings_seen_medians_in_window():
    samples = [
        {"t_s": t, "status": {"models": {"m": {"max_batch_size": b, "batch_wait_timeout_s": w}}}}
        for t, b, w in [(0.5, 99, 9.0), (1.0, 8, 0.01), (2.0, 16, 0.03), (3.0, 24, 0.05)]
    ]
    seen = lg.settings_seen(samples, "m", lo_s=1.0, hi_s=3.5)
    assert seen["max_batch_size"] == {"median": 16.0, "min": 8.0, "max": 24.0}
    assert seen["batch_wait_timeout_s"]["median"] == pytest.approx(0.03)
    assert lg.settings_seen(samples, "other") == {"max_batch_size": None, "batch_wait_timeout_s": None}


def test_eager_saturation_is_below_the_lazy_bound():
    from bench import scenarios as sc

    assert sc.eager_batch(100.0, 8, 10.0) == pytest.approx(2.0)
    assert sc.eager_batch(1000.0, 8, 10.0) == 8.0
    # a=20, c=0.5, static 8:10: b = 1 + 0.01 r; r (20 + 0.5 b) = 1000 b  ->  about 91/s, far under 8/(a + 8c) = 333/s
    sat = sc.eager_saturation(8, 10.0, 20.0, 0.5)
    assert 85.0 < sat < 95.0
    b = sc.eager_batch(sat, 8, 10.0)
    assert sat * (20.0 + 0.5 * b) / 1000.0 / b == pytest.approx(1.0, abs=1e-6)
    # a wait long enough to fill the batch: the lazy bound b / (a + c b)
    assert sc.eager_saturation(16, 300.0, 20.0, 0.5) == pytest.approx(16000.0 / 28.0)
    # time scale: x10 slower profile and wait -> rates / 10
    assert sc.eager_saturation(8, 100.0, 200.0, 5.0) == pytest.approx(sat / 10.0, rel=1e-6)


def test_live_knee_uses_the_shared_search_and_its_run_budget():
    from types import SimpleNamespace

    from bench import scenarios as sc

    runs: list[float] = []

    def run_rate(rate):
        runs.append(rate)
        return SimpleNamespace(passes=rate <= 40.0, row=lambda: {"rate": rate})

    knee, rows = sc.live_knee(run_rate, 10.0, step=2.0, bisect_iters=3, max_runs=12)
    assert 20.0 <= knee <= 40.0 and len(rows) == len(runs) <= 12
    runs.clear()
    sc.live_knee(run_rate, 10.0, step=1.1, bisect_iters=5, max_runs=4)
    assert len(runs) == 4
