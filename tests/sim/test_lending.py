"""Where memory binds, lending buys goodput (bench/lending.py's card, short runs in the simulator).

Four models, each held to a batch of 4 by its base quota; one bursts at a time to a rate a
batch of 4 cannot serve. The static split and the broker with quotas fixed at base drown; the
broker lends the idle models' memory to the bursting one. Memory is enforced as the simulator
does it (a batch over its grant runs out of memory and is split), and no sample may show a
model above its grant.
"""

from __future__ import annotations

from bench import lending as L
from broker.lending import plan_quota  # noqa: F401 - the policy under test runs inside the simulator


def _in_turn():
    times, windows = L.in_turn(5.0, 550.0, 30.0, 18.0, seed=1)
    return times, windows, 30.0 * len(L.MODELS)


def test_lending_buys_fleet_goodput_where_memory_binds():
    times, windows, duration = _in_turn()
    static = L.run_arm(L.fleet(fixed=True), f"static:{L.STATIC_CAP}:10", times, duration, 5.0, windows)
    fixed = L.run_arm(L.fleet(fixed=True), "broker", times, duration, 5.0, windows)
    broker = L.run_arm(L.fleet(), "broker", times, duration, 5.0, windows)
    assert broker["fleet_goodput_rps"] >= L.TARGET_GAIN * static["fleet_goodput_rps"]
    assert broker["fleet_goodput_rps"] >= L.TARGET_GAIN * fixed["fleet_goodput_rps"]
    assert broker["quota_moves"] > 0 and fixed["quota_moves"] == 0
    for arm in (static, fixed, broker):
        assert arm["over_grant_events"] == 0
    assert min(m["attainment_off_burst"] for m in broker["models"].values()) >= 0.99
    # the bursting model got memory beyond its base while it burst
    assert max(m["mem_peak_bytes"] for m in broker["models"].values()) > 3.5 * L.GIB


def test_the_static_cap_is_what_the_base_quota_holds():
    cfg = L.fleet(fixed=True)
    spec = cfg.models["m0"]
    per_item = spec.options["bytes_per_item"]
    room = 0.9 * spec.quota.base - spec.options["weights_bytes"]
    assert int(room // per_item) == L.STATIC_CAP


def test_a_lender_whose_loans_keep_coming_back_waits_longer_before_it_lends_again():
    """Independent bursts: a model that lends while idle and reclaims soon after, because its
    own burst came, doubles its idle hold (lend regret); the decision log says so."""
    times = L.independent(L.IND_MEAN_RPS, 90.0, seed=0)
    from bench.sim import Simulator, parse_arm

    cfg = L.fleet()
    sim = Simulator(cfg, parse_arm("broker"), L._workload(cfg, times), 90.0)
    sim.run()
    core = sim.broker.core
    scales = core._state.lend_scale  # noqa: SLF001 - the policy's state
    assert scales and max(scales.values()) >= 2.0
    assert any("lends again only after" in e["reason"] for e in core.decisions() if e["kind"] == "move")
    for name, s in scales.items():
        assert 1.0 <= s <= cfg.models[name].control.lend_backoff_max


def test_on_the_contention_load_lending_costs_no_model_anything():
    """Every model bursting on its own (gamma CV 4), all contending: the broker with lending
    serves every model at least as well as the broker with quotas fixed at base, request for
    request, on each seed: a lender keeps what its own window's peak needed, and a model
    borrows only while its memory holds it back (bench lending's independent load, shortened)."""
    for seed in (0, 1):
        times = L.independent(L.IND_MEAN_RPS, 150.0, seed)
        fixed = L.run_arm(L.fleet(fixed=True), "broker", times, 150.0, 10.0)
        broker = L.run_arm(L.fleet(), "broker", times, 150.0, 10.0)
        assert fixed["quota_moves"] == 0 and broker["over_grant_events"] == 0
        for m in L.MODELS:
            b, f = broker["models"][m], fixed["models"][m]
            assert b["attainment"] >= f["attainment"], (seed, m, b["attainment"], f["attainment"])


def test_the_independent_load_reports_the_target_and_the_two_readings_beside_it():
    """``independent_load``: the issue's target (every model, every seed, at least the static
    split) and, beside it, broker against broker-fixed and each model summed over the seeds."""
    res = L.independent_load(60.0, (0,), warmup_s=5.0)
    arms = res["seeds"]["0"]
    short = [
        m
        for m in L.MODELS
        if arms["broker"]["models"][m]["attainment"] < arms["static-split"]["models"][m]["attainment"]
    ]
    assert res["never_worse"] == (not short) and [x["model"] for x in res["short"]] == short
    cost = [
        m
        for m in L.MODELS
        if arms["broker"]["models"][m]["attainment"] < arms["broker-fixed"]["models"][m]["attainment"]
    ]
    assert res["moves_never_cost"] == (not cost)
    for arm in ("broker", "static-split"):
        for m in L.MODELS:
            mm = arms[arm]["models"][m]
            assert res["within_slo_summed"][arm][m] == round(mm["attainment"] * mm["offered"], 1)
    summed = res["within_slo_summed"]
    assert res["summed_never_worse"] == all(summed["broker"][m] >= summed["static-split"][m] for m in L.MODELS)
