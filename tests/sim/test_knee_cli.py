"""Knee search, bound, cap override, and the `gpubroker simulate` command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gpubroker.cli.main import app
from gpubroker.sim.knee import (
    OracleGrid,
    RunSettings,
    Search,
    bound,
    bound_batch,
    knee,
    oracle,
    reference_rate,
    with_cap,
)
from gpubroker.sim.profile import profile_for
from tests.sim.conftest import fleet, profiled


def test_bound_matches_benchmark_table():
    assert bound(20, 0.5, 52.0) == pytest.approx((1 - 40 / 52) / 0.5 * 1000)
    assert bound(20, 0.5, 1.2 * 43.3) == pytest.approx(461, rel=0.01)  # BENCHMARK.md's fluid bound
    assert bound(10, 2, 1.2 * 35.3) == pytest.approx(264, rel=0.01)
    assert bound_batch(20, 0.5, 52) == pytest.approx(12)


def test_with_cap_overrides_slo_in_a_copy(a20):
    cfg = with_cap(a20, {"prof": 61.5})
    assert cfg.models["prof"].slo_p95_ms == 61.5 and a20.models["prof"].slo_p95_ms == 52
    with pytest.raises(Exception):
        cfg.models["prof"].slo_p95_ms = 1  # still frozen


def test_static8_knee_near_benchmark(a20):
    cfg = with_cap(a20, {"prof": 43.4})
    rs = RunSettings(duration_s=60.0, warmup_s=10.0, batching="lazy")  # BENCHMARK.md's quick model
    ref = reference_rate(profile_for("prof", a20.models["prof"]))
    k = knee(cfg, "static:8:10", ref, rs, search=Search(bisect_iters=4))
    # BENCHMARK.md's 164/s was the knee by P95 ≤ S; S is static 8's P95 at the reference rate, so
    # there ~5 % of its answers are late: by attainment (a late answer is a miss) the knee is lower
    assert 0.5 * ref < k.knee_rps < ref
    assert any(r["pass"] for r in k.rows) and any(not r["pass"] for r in k.rows)
    assert all(r["prof"]["attainment"] >= 0.99 for r in k.rows if r["pass"])


def test_oracle_prefers_large_batch_with_no_wait():
    cfg = fleet({"prof": profiled(20, 0.5, slo_ms=52)})
    rs = RunSettings(duration_s=30.0, warmup_s=5.0, batching="lazy")
    best, arm, arms = oracle(
        cfg,
        166.7,
        rs,
        grid=OracleGrid(batches=(128, 8), waits_ms=(0.0, 10.0), gates=(False,)),
        search=Search(bisect_iters=2),
    )
    assert arm == "static:128:0" and best > 350  # bound (1 − 2a/C)/c = 461/s bounds the maximum latency
    assert len(arms) == 4


def test_oracle_needs_a_wait_with_eager_batching():
    """Ray 2.60 forms batches eagerly: with no wait every request is its own batch, so the
    best static arm has a wait and wait 0 saturates near 1/a = 50/s."""
    cfg = fleet({"prof": profiled(20, 0.5, slo_ms=60)})
    rs = RunSettings(duration_s=30.0, warmup_s=5.0, batching="eager")
    best, arm, arms = oracle(
        cfg,
        40.0,
        rs,
        grid=OracleGrid(batches=(128, 8), waits_ms=(0.0, 10.0, 30.0), gates=(False,)),
        search=Search(bisect_iters=2),
    )
    assert not arm.endswith(":0") and best > 150
    zero = knee(cfg, "static:128:0", 20.0, rs, search=Search(bisect_iters=2)).knee_rps
    assert zero < 55


runner = CliRunner()


def test_cli_simulate_json():
    r = runner.invoke(
        app,
        [
            "simulate",
            "configs/sim-a20-c0.5.yaml",
            "--policy",
            "static:8",
            "--rate",
            "100",
            "--duration-s",
            "10",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["arm"] == "static:8:10" and out["models"]["prof"]["offered"] > 800


def test_cli_table_and_sweep():
    r = runner.invoke(app, ["simulate", "configs/sim-three.yaml", "--policy", "static:8", "--duration-s", "5"])
    assert r.exit_code == 0, r.output
    assert "alpha" in r.output and "p95" in r.output
    r = runner.invoke(
        app,
        [
            "simulate",
            "configs/sim-a20-c0.5.yaml",
            "--policy",
            "static:8",
            "--sweep",
            "--duration-s",
            "20",
            "--json",
            "--batching",
            "lazy",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["knee_rps"] > 100


def test_cli_bad_policy_names_accepted_forms():
    r = runner.invoke(app, ["simulate", "configs/sim-a20-c0.5.yaml", "--policy", "fixed"])
    assert r.exit_code == 2
    assert "static:B:WAIT_MS" in r.output and "broker" in r.output


def test_cli_refuses_auto_capacity(tmp_path):
    p = tmp_path / "auto.yaml"
    p.write_text("models:\n  m:\n    model: profiled\n    quota: {min: 1GiB, base: 2GiB, max: 4GiB}\n")
    r = runner.invoke(app, ["simulate", str(p)])
    assert r.exit_code == 1
    assert "gpu.capacity" in r.output and "explicit size" in r.output


def test_search_knee_climbs_bisects_and_respects_budgets():
    from gpubroker.sim.knee import search_knee

    calls: list[float] = []

    def ok(rate):
        calls.append(rate)
        return rate <= 137.0

    k = search_knee(ok, 100.0, step=1.1, bisect_iters=8)
    assert 130.0 < k <= 137.0
    assert search_knee(lambda r: r <= 50.0, 100.0, step=1.1, bisect_iters=4) <= 50.0  # steps down first
    assert search_knee(lambda r: False, 100.0, bisect_iters=2) == 0.0
    calls.clear()
    search_knee(ok, 100.0, step=1.1, bisect_iters=8, max_runs=5)
    assert len(calls) == 5
    assert search_knee(lambda r: True, 100.0, max_rate=150.0) == 150.0


def test_cli_simulates_one_card_of_a_cluster_fleet():
    """A gpus: fleet runs one card at a time (lending is per card): the models placement puts on
    it, with the card's capacity; without --card the error names the cards to choose from."""
    r = runner.invoke(app, ["simulate", "configs/cluster-demo.yaml", "--duration-s", "5"])
    assert r.exit_code == 1 and "--card" in r.output and "a0, a1, b0, b1" in " ".join(r.output.split())
    r = runner.invoke(app, ["simulate", "configs/cluster-demo.yaml", "--card", "a1", "--duration-s", "10", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert set(out["models"]) == {"cnn", "profiled"}  # a1's models (README's placement), not the fleet's four
    assert all(m["offered"] > 0 for m in out["models"].values())
    r = runner.invoke(app, ["simulate", "configs/cluster-demo.yaml", "--card", "c9"])
    assert r.exit_code == 1 and "use one of a0, a1, b0, b1" in " ".join(r.output.split())


def test_cli_simulate_takes_the_config_as_an_argument_and_names_the_knee_check():
    """The config is positional, as in every command; the headline benchmark is --knee-check, and
    the old flags are gone (click refuses them)."""
    r = runner.invoke(app, ["simulate", "configs/sim-a20-c0.5.yaml", "--duration-s", "5", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["models"]["prof"]["offered"] > 0
    for old in (["--config", "configs/sim-a20-c0.5.yaml"], ["configs/sim-a20-c0.5.yaml", "--validate"]):
        r = runner.invoke(app, ["simulate", *old])
        assert r.exit_code == 2 and "No such option" in r.output, r.output
    r = runner.invoke(app, ["simulate", "configs/sim-three.yaml", "--knee-check"])
    assert r.exit_code == 2 and "--knee-check takes a one-model profile config" in " ".join(r.output.split())
    r = runner.invoke(app, ["simulate", "-h"])
    assert r.exit_code == 0 and "--knee-check" in r.output and "--validate" not in r.output
