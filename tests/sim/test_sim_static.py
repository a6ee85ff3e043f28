"""The simulator's mechanics with static arms (no policy needed)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from gpubroker.quotas.config import load_config
from gpubroker.sim.engine import SimOptions, Simulator, run_sim
from gpubroker.sim.profile import profile_for
from gpubroker.sim.types import DONE, Arm, parse_arm
from gpubroker.sim.workload import ModelArrivals, make_workload
from tests.sim.conftest import GiB, MiB, fleet, profiled


def _one(times, costs=None):
    t = np.asarray(times, dtype=float)
    c = np.ones(len(t), dtype=np.int64) if costs is None else np.asarray(costs, dtype=np.int64)
    return ModelArrivals(t, c, c.copy())


def test_parse_arm_forms_and_error():
    assert parse_arm("broker") == Arm("broker")
    assert parse_arm("static:8") == Arm("static", 8, 10.0)
    assert parse_arm("static:32:5") == Arm("static", 32, 5.0)
    for bad in ("fixed", "static", "static:0", "static:x", "static:8:-1"):
        with pytest.raises(ValueError, match="static:B:WAIT_MS"):
            parse_arm(bad)


def test_auto_capacity_refused_with_the_fix():
    cfg = fleet({"m": profiled(20, 0.5)}, capacity="auto")
    with pytest.raises(ValueError, match="gpu.capacity"):
        run_sim(cfg, "static:8", {"m": 10}, 5)


def test_batch_waits_for_timeout_then_runs():
    cfg = fleet({"m": profiled(20, 0.5)})
    sim = Simulator(cfg, Arm("static", 8, 10.0), {"m": _one([0.0])}, 1.0, opts=SimOptions(drain_s=1.0))
    sim.run()
    assert sim.status[0] == DONE
    assert sim.done_t[0] == pytest.approx(0.010 + 0.0205)


def test_full_batch_starts_at_once_and_next_waits_for_previous():
    cfg = fleet({"m": profiled(20, 0.5)})
    sim = Simulator(cfg, Arm("static", 4, 10.0), {"m": _one([0.0] * 6)}, 1.0, opts=SimOptions(drain_s=1.0))
    sim.run()
    l4, l2 = 0.022, 0.021
    assert sim.done_t[:4] == pytest.approx([l4] * 4)
    # the last two waited 10 ms from their arrival, i.e. they start as soon as the first batch ends
    assert sim.done_t[4:] == pytest.approx([l4 + l2] * 2)


def test_processor_sharing_between_models():
    cfg = fleet({"m1": profiled(10, 0.0), "m2": profiled(10, 0.0)})
    sim = Simulator(
        cfg, Arm("static", 1, 0.0), {"m1": _one([0.0]), "m2": _one([0.005])}, 1.0, opts=SimOptions(drain_s=1.0)
    )
    sim.run()
    # m1 alone for 5 ms (half its work), then both at half speed: m1 ends at 15 ms, m2 at 20 ms
    assert sorted(sim.done_t.tolist()) == pytest.approx([0.015, 0.020])


def test_token_model_counts_tokens_against_the_cap():
    cfg = fleet({"t": profiled(5, 0.01, unit="tokens", per_item=1024)})
    w = {"t": _one([0.0, 0.0, 0.0, 0.0], [100, 100, 100, 300])}
    sim = Simulator(cfg, Arm("static", 2, 5.0), w, 1.0, opts=SimOptions(drain_s=1.0))  # B=2 x mean 150 tokens = 300
    sim.run()
    sizes = [n for (_, _, n, _, _) in sim.batch_log]
    costs = [c for (_, _, _, c, _) in sim.batch_log]
    assert sizes == [3, 1] and costs == [300.0, 300.0]


def test_static8_saturated_throughput(a20):
    res = run_sim(a20, "static:8", {"prof": 600.0}, 60.0, opts=SimOptions(seed=1, drain_s=0.0, batching="lazy"))
    m = res.models["prof"]
    assert m.completed / 60.0 == pytest.approx(8 / (0.020 + 8 * 0.0005), rel=0.05)
    assert m.mean_batch == pytest.approx(8.0, abs=0.1)


def test_eager_batches_do_not_grow_while_the_replica_is_busy(a20):
    """Ray 2.60: a batch closes wait_s after its first request whatever the replica is doing."""
    lazy = run_sim(a20, "static:8:0", {"prof": 150.0}, 30.0, opts=SimOptions(seed=1, batching="lazy")).models["prof"]
    eager = run_sim(a20, "static:8:0", {"prof": 150.0}, 30.0, opts=SimOptions(seed=1, batching="eager")).models["prof"]
    assert lazy.mean_batch > 2.5 and lazy.p95_ms < 60
    assert eager.mean_batch < 1.1  # every request its own batch: 150/s > 1/a = 50/s, it falls behind
    assert eager.p95_ms > 1000
    waited = run_sim(a20, "static:8:30", {"prof": 150.0}, 30.0, opts=SimOptions(seed=1, batching="eager")).models[
        "prof"
    ]
    assert 4.0 < waited.mean_batch < 6.5  # about 1 + rate x wait
    assert waited.p95_ms < 80


def test_reference_point_matches_benchmark(a20):
    """S (static 8, wait 10 ms, at half saturation) is about 43 ms, as BENCHMARK.md expects."""
    res = run_sim(a20, "static:8:10", {"prof": 1000 / 6}, 120.0, opts=SimOptions(seed=0, batching="lazy"))
    assert res.models["prof"].p95_ms == pytest.approx(43.0, rel=0.05)


def test_deterministic_same_seed_same_report(a20):
    a = run_sim(a20, "static:16:5", {"prof": 250.0}, 30.0, opts=SimOptions(seed=7)).to_dict()
    b = run_sim(a20, "static:16:5", {"prof": 250.0}, 30.0, opts=SimOptions(seed=7)).to_dict()
    for d in (a, b):
        d.pop("wall_s")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c = run_sim(a20, "static:16:5", {"prof": 250.0}, 30.0, opts=SimOptions(seed=8)).to_dict()
    assert c["models"] != a["models"]


def test_oom_splits_counted_and_no_request_lost():
    # grant = base 1.5GiB, weights 1GiB, 64MiB per item: 8 items fit, a batch of 32 does not
    cfg = fleet({"m": profiled(10, 0.5, weights=1 * GiB, per_item=64 * MiB, base="1.5GiB", mx="4GiB", mn="1.1GiB")})
    res = run_sim(cfg, "static:32:20", {"m": 300.0}, 20.0, opts=SimOptions(seed=3, drain_s=10.0))
    m = res.models["m"]
    assert m.ooms > 0
    assert m.completed == m.offered and m.rejects == m.timeouts == m.errors == m.unfinished == 0
    assert m.mem_peak_bytes <= 1.5 * GiB


def test_single_request_over_the_grant_fails_not_hangs():
    cfg = fleet({"m": profiled(10, 0.5, weights=1 * GiB, per_item=2 * GiB, base="2GiB", mx="4GiB", mn="1.1GiB")})
    res = run_sim(cfg, "static:4", {"m": 20.0}, 5.0, opts=SimOptions(seed=1))
    m = res.models["m"]
    assert m.errors == m.offered > 0 and m.completed == 0 and m.attainment == 0


def test_rejects_and_timeouts_are_misses():
    spec = profiled(20, 0.5, slo_ms=1000)
    spec.update(max_queued=20, request_timeout_s=0.5)
    cfg = fleet({"m": spec})
    res = run_sim(cfg, "static:8", {"m": 800.0}, 10.0, opts=SimOptions(seed=1))
    m = res.models["m"]
    assert m.rejects > 0
    assert m.attainment <= (m.offered - m.rejects - m.timeouts) / m.offered + 1e-9
    spec2 = profiled(20, 0.5, slo_ms=1000)
    spec2.update(request_timeout_s=0.2)
    res2 = run_sim(fleet({"m": spec2}), "static:8", {"m": 800.0}, 10.0, opts=SimOptions(seed=1))
    assert res2.models["m"].timeouts > 0


def test_default_profile_for_non_profiled_models():
    cfg = load_config("configs/demo.yaml")
    p = profile_for("mlp", cfg.models["mlp"])
    assert not p.profiled and p.a_ms == 5.0 and p.c_ms == 1.0
    assert p.memory_bytes(cfg.models["mlp"].batch.ceiling) == pytest.approx(cfg.models["mlp"].quota.base, rel=1e-6)
    assert profile_for("minilm", cfg.models["minilm"]).unit == "tokens"


def test_workload_tokens_for_token_models():
    cfg = load_config("configs/demo.yaml")
    profiles = {n: profile_for(n, s) for n, s in cfg.models.items()}
    w = make_workload(profiles, {"minilm": 50, "cnn": 10, "mlp": 0}, 60.0, "poisson", seed=1)
    assert w["minilm"].costs.mean() == pytest.approx(128, rel=0.1)
    assert np.all(w["cnn"].costs == 1) and len(w["mlp"].times) == 0
    w2 = make_workload(profiles, {"minilm": 20}, 30.0, "trace", seed=1)  # the vendored Azure trace
    assert w2["minilm"].costs.mean() > 500  # ContextTokens


def test_series_kept_per_control_interval(a20):
    res = run_sim(a20, "static:8", {"prof": 100.0}, 10.0, opts=SimOptions(drain_s=0.0))
    s = res.series["prof"]
    assert s["t"][:3] == [0.0, 1.0, 2.0]
    assert set(s) >= {"max_batch", "wait_ms", "grant_bytes", "queue"}
    assert s["max_batch"][0] == 8 and s["wait_ms"][0] == pytest.approx(10.0)


def test_ten_minutes_of_three_models_static_is_fast():
    cfg = load_config("configs/sim-three.yaml")
    t0 = time.perf_counter()
    res = run_sim(cfg, "static:8", {"alpha": 131, "beta": 93, "gamma": 76}, 600.0, opts=SimOptions(seed=0))
    assert time.perf_counter() - t0 < 10.0
    assert sum(m.offered for m in res.models.values()) > 150_000
