"""Where memory binds, lending buys goodput (bench/lending.py's card, short runs in the simulator).

Four models, each held to a batch of 5 by its base quota; one bursts at a time to 1.5x what
batches of 5 serve. The static split drowns (its queue answers the burst late); the broker with
quotas fixed at base sheds what cannot meet the SLO and serves its batches' worth; the broker
lends the idle models' memory to the bursting one. Memory is enforced as the simulator
does it (a batch over its grant runs out of memory and is split), and no sample may show a
model above its grant.
"""

from __future__ import annotations

from bench import lending as L
from gpubroker.broker.control.lending import plan_quota  # noqa: F401 - the policy under test runs inside the simulator

LENDING_GAIN_SHORT = 1.25  # borrowed memory over quotas fixed at base on the shortened in-turn load


def _in_turn(burst_rps: float | None = None):
    """The in-turn load, shortened; the burst is the benchmark's (1.5 x what batches of 5 serve)."""
    burst = L.BURST_OVER_STATIC * L.STATIC_RPS if burst_rps is None else burst_rps
    times, windows = L.in_turn(5.0, burst, 30.0, 18.0, seed=1)
    return times, windows, 30.0 * len(L.MODELS)


def test_lending_buys_fleet_goodput_where_memory_binds():
    """Both broker arms shed requests too late for the SLO, so the quotas-fixed arm serves what
    its batches of 5 can: the gain over it is what the borrowed memory buys. It is 1.29 on this
    short run (389.9 / 302.4 req/s), below the benchmark's 1.3: that figure (1.33) was measured
    against a quotas-fixed arm that left a tenth of its grant unused (batches of 4 where its base
    holds 5); the memory slack is learned now (``memory_model.measured_slack``), nil on the emulated card."""
    times, windows, duration = _in_turn()
    static = L.run_arm(L.fleet(fixed=True), f"static:{L.STATIC_CAP}:10", times, duration, 5.0, windows)
    fixed = L.run_arm(L.fleet(fixed=True, **L.BROKER_OPTS), "broker", times, duration, 5.0, windows)
    broker = L.run_arm(L.fleet(**L.BROKER_OPTS), "broker", times, duration, 5.0, windows)
    assert broker["fleet_goodput_rps"] >= L.TARGET_GAIN * static["fleet_goodput_rps"]
    assert broker["fleet_goodput_rps"] >= LENDING_GAIN_SHORT * fixed["fleet_goodput_rps"]
    assert broker["quota_moves"] > 0 and fixed["quota_moves"] == 0
    for arm in (static, fixed, broker):
        assert arm["over_grant_events"] == 0
    assert min(m["attainment_off_burst"] for m in broker["models"].values()) >= 0.99
    # the bursting model got memory beyond its base while it burst
    assert max(m["mem_peak_bytes"] for m in broker["models"].values()) > 3.5 * L.GIB


def test_without_shedding_an_arm_whose_burst_outruns_its_batches_answers_it_all_late():
    """Why the broker arms shed: a FIFO queue under a burst its batches cannot serve answers
    nearly every burst request after the SLO (the quotas-fixed broker without shed_late), and
    with shed_late the same arm serves its batches' worth within it. The static arm has no gate,
    so shed_late changes nothing there."""
    times, windows, duration = _in_turn()
    late = L.run_arm(L.fleet(fixed=True), "broker", times, duration, 5.0, windows)
    shed = L.run_arm(L.fleet(fixed=True, shed_late=True), "broker", times, duration, 5.0, windows)
    assert shed["fleet_goodput_rps"] >= 5 * late["fleet_goodput_rps"]
    for m in L.MODELS:
        assert late["models"][m]["attainment_in_burst"] < 0.05
        assert shed["models"][m]["attainment_in_burst"] > 0.5
        assert shed["models"][m]["timeouts"] > 0  # shed requests are answered (504), not lost
    arm = f"static:{L.STATIC_CAP}:10"
    plain = L.run_arm(L.fleet(fixed=True), arm, times, duration, 5.0, windows)
    asked = L.run_arm(L.fleet(fixed=True, shed_late=True), arm, times, duration, 5.0, windows)
    assert plain["models"] == asked["models"]


def test_on_the_contention_load_the_broker_serves_every_model_at_least_as_well_as_the_static_split():
    """bench lending's independent load, shortened (150 s, seeds 0-1): the broker (shed_late,
    lending on) against the static split, request for request on each model."""
    for seed in (0, 1):
        times = L.independent(L.IND_MEAN_RPS, 150.0, seed)
        static = L.run_arm(L.fleet(fixed=True), f"static:{L.STATIC_CAP}:10", times, 150.0, 10.0)
        broker = L.run_arm(L.fleet(**L.BROKER_OPTS), "broker", times, 150.0, 10.0)
        assert broker["over_grant_events"] == 0
        for m in L.MODELS:
            b, s = broker["models"][m]["attainment"], static["models"][m]["attainment"]
            assert b >= s, (seed, m, b, s)


def test_the_static_cap_is_what_the_base_quota_holds():
    cfg = L.fleet(fixed=True)
    spec = cfg.models["m0"]
    per_item = spec.options["bytes_per_item"]
    room = spec.quota.base - spec.options["weights_bytes"]  # the emulated card holds what is modelled
    assert int(room // per_item) == L.STATIC_CAP


def test_a_lender_whose_loans_keep_coming_back_waits_longer_before_it_lends_again():
    """Short bursts in turn, two rounds (12-s phases, 8-s bursts): a model that lends while idle
    and reclaims soon after, because its own burst came, doubles its idle hold (lend regret); the
    decision log says so. (On the independent load at 40 req/s no model is behind at the batch of
    5 its base holds, so none borrows and none lends.)"""
    import numpy as np

    from gpubroker.sim.engine import Simulator, parse_arm

    burst = L.BURST_OVER_STATIC * L.STATIC_RPS
    first, _ = L.in_turn(5.0, burst, 12.0, 8.0, seed=0)
    second, _ = L.in_turn(5.0, burst, 12.0, 8.0, seed=10)
    times = [np.concatenate([a, 48.0 + b]) for a, b in zip(first, second)]
    cfg = L.fleet()
    sim = Simulator(cfg, parse_arm("broker"), L.workload(cfg, times), 96.0)
    sim.run()
    core = next(iter(sim.broker.broker.cores.values()))  # the one card's core
    scales = core._state.lend_scale  # noqa: SLF001 - the policy's state
    assert scales and max(scales.values()) >= 2.0
    assert any("lends again only after" in e["reason"] for e in core.decisions() if e["kind"] == "move")
    for name, s in scales.items():
        assert 1.0 <= s <= cfg.models[name].control.lend_backoff_max


def test_on_the_contention_load_lending_costs_no_model_anything():
    """Every model bursting on its own (gamma CV 4), all contending: the broker with lending
    serves every model as well as the broker with quotas fixed at base, on each seed: a lender
    keeps what its own window's peak needed, and a model borrows only while its memory holds it
    back (bench lending's independent load, shortened). As well as, within 0.1 % of its requests
    (3 of about 2,800): on this load lending moves a few requests either way, and any change to
    the control's timing reorders which (a request short on one seed and model here, or in
    ``bench lending``'s 600-s runs, on every version of the code since shedding). The margin is
    a sixth of what the broker gains over the static split on this load (0.4-0.8 points)."""
    for seed in (0, 1):
        times = L.independent(L.IND_MEAN_RPS, 150.0, seed)
        fixed = L.run_arm(L.fleet(fixed=True), "broker", times, 150.0, 10.0)
        broker = L.run_arm(L.fleet(), "broker", times, 150.0, 10.0)
        assert fixed["quota_moves"] == 0 and broker["over_grant_events"] == 0
        for m in L.MODELS:
            b, f = broker["models"][m], fixed["models"][m]
            assert b["attainment"] >= f["attainment"] - 0.001, (seed, m, b["attainment"], f["attainment"])


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


def _demo_prof(seed: int):
    """``make demo``'s ``prof`` as the simulator has it: 30 ms + 0.5 ms an item, 40 MiB fixed (what
    the broker measured on 2026-12-03's machine; the config says 32) + 2 MiB an item, so its
    42 MiB base holds a batch of 1. Its burst: requests of 16 items (16 requests at one instant
    here) at 2.6 a second for 40 s, beside ``cnn``, which lends."""
    import numpy as np

    from gpubroker.quotas.config import parse_config
    from gpubroker.sim.workload import ModelArrivals

    mib = 1 << 20
    doc = {
        "broker": {"control_interval_s": 1.0, "report_interval_s": 0.5},
        "gpu": {"device": "cpu", "capacity": "1GiB", "reserve_frac": 0.0},
        "models": {
            "prof": {
                "model": "profiled",
                "options": {"a_ms": 30, "c_ms": 0.5, "weights_bytes": 40 * mib, "bytes_per_item": 2 * mib},
                "quota": {"min": "40MiB", "base": "42MiB", "max": "200MiB"},
                "batch": {"floor": 1, "ceiling": 48},
                "wait": {"min_ms": 0, "max_ms": 10},
                "slo_p95_ms": 300,
                "shed_late": True,
            },
            "cnn": {
                "model": "profiled",
                "options": {"a_ms": 5, "c_ms": 0.5, "weights_bytes": 20 * mib, "bytes_per_item": mib},
                "quota": {"min": "128MiB", "base": "288MiB", "max": "512MiB"},
                "batch": {"floor": 2, "ceiling": 64},
                "slo_p95_ms": 250,
            },
        },
        "profiles": {"schedule": [{"name": "flat", "default": True, "objective": "latency", "price_per_gpu_hour": 1}]},
    }
    rng = np.random.default_rng(seed)
    burst = np.cumsum(rng.exponential(1 / 2.6, 200))
    prof = np.repeat(20.0 + burst[burst < 40.0], 16)
    cnn = np.cumsum(rng.exponential(1 / 3.0, 400))
    cnn = cnn[cnn < 80.0]

    def arrivals(times):
        ones = np.ones(len(times), dtype=np.int64)
        return ModelArrivals(times, ones, ones)

    return parse_config(doc, "demo-prof"), {"prof": arrivals(prof), "cnn": arrivals(cnn)}


def test_a_borrower_keeps_its_loan_through_its_burst_though_the_loan_makes_it_look_idle():
    """At cap 48 on borrowed memory ``prof``'s burst keeps it about 10 % busy, under
    ``idle_util_frac``; at the batch of 1 its base holds, the same requests (42 items a second at
    30.5 ms an item) are more than it can serve, and each 16-item request takes 16 batches (490 ms,
    over its 300 ms SLO). Before the fix its loan
    went back in the burst one to three times a run on seeds 0-2, each time it fell behind at cap
    1 and borrowed again, and it answered 91-96 % within its SLO (the demo's ``prof``, 27 % on
    2026-12-03); now the loan goes back only after the burst, and 96-99 %."""
    from gpubroker.sim.engine import SimOptions, run_sim

    for seed in range(3):
        config, workload = _demo_prof(seed)
        result = run_sim(config, "broker", {}, 80.0, workload=workload, opts=SimOptions(batching="lazy"))
        releases = [d["t"] for d in result.decisions if d.get("move") == "release"]
        burst_end = float(workload["prof"].times[-1])
        assert releases and min(releases) > burst_end, (seed, releases, burst_end)
        assert result.models["prof"].attainment >= 0.95, seed
