"""The live oracle's screen: the whole static grid (both formations, as the simulator's oracle) in
the simulator, best candidates first."""

from __future__ import annotations

from bench import scenarios as sc
from bench.live_oracle import GRID_BATCHES, GRID_GATES, GRID_WAITS_MS, HTTP_MS, screen_arms, screen_grid
from bench.live_runs import Opts, profiled_workload
from gpubroker.quotas.config import parse_config_text
from gpubroker.sim.knee import KneeResult, OracleGrid, RunSettings, run_at
from gpubroker.sim.types import Arm


def test_screen_ranks_the_grid_and_keeps_distinct_candidates():
    o = Opts(time_scale=10.0)
    w = profiled_workload(10.0)
    cap = 630.0
    rates = [4.6, 45.0]
    got = screen_grid(w, cap, rates, 3, o)
    assert set(got) == set(rates)
    for r in rates:
        cands = got[r]
        assert len(cands) == 3
        goods = [c["sim_goodput_rps"] for c in cands]
        assert goods == sorted(goods, reverse=True)
        assert len({(c["sim_goodput_rps"], c["sim_p95_ms"]) for c in cands}) == 3  # distinct results
    # at 45/s only a long wait fills batches under eager formation: the best eager arm waits; the
    # gate fills them without one, and a gated arm is among the candidates; the best beats static 8
    # at 10 ms (x10) run the same way
    eager = [c for c in got[45.0] if not c["gated"]]
    assert eager and eager[0]["wait_ms"] > 0
    assert any(c["gated"] and c["arm"].endswith(":gate") for c in got[45.0])
    best = got[45.0][0]
    cfg = parse_config_text(sc.fleet_yaml({w.model: w.spec(cap - HTTP_MS)}, broker_name="t"))
    s8 = run_at(cfg, "static:8:100", 45.0, RunSettings(duration_s=60.0, warmup_s=5.0, drain_s=2.0, batching="eager"))
    assert best["sim_goodput_rps"] > s8.models[w.model].goodput_rps


def test_knee_screen_picks_distinct_arms_by_simulated_knee():
    from bench.live_oracle import screen_knees

    w = profiled_workload(10.0)
    got = screen_knees(w, 688.0, 60.0, 3, Opts(time_scale=10.0))
    knees = [c["sim_knee_rps"] for c in got]
    assert len(got) == 3 and knees == sorted(knees, reverse=True) and len(set(knees)) == 3
    # the best arm's wait fits well inside the cap (a 500 ms wait alone nearly fills 688 ms)
    assert got[0]["wait_ms"] < 500 and got[0]["sim_knee_rps"] > 40


def test_the_screened_grid_is_every_batch_and_wait_in_both_formations_of_the_simulator_oracle():
    assert GRID_GATES == OracleGrid().gates == (False, True)
    arms = screen_arms(10.0)
    want = {Arm("static", b, w * 10.0, g) for g in (False, True) for b in GRID_BATCHES for w in GRID_WAITS_MS}
    assert len(arms) == len(want) == 2 * len(GRID_BATCHES) * len(GRID_WAITS_MS) and set(arms) == want
    labels = {a.label for a in arms}
    assert {"static:8:100", "static:8:100:gate", "static:128:0:gate", "static:128:500"} <= labels


def test_knee_screen_ranks_gated_and_eager_arms_together(monkeypatch):
    """A fake knee (no simulation): the screen asks for every arm's knee and keeps the gated
    flag of those it picks, so the live run deploys the right formation."""
    import gpubroker.sim.knee as knee_mod
    from bench.live_oracle import screen_knees

    asked: list[Arm] = []

    def fake_knee(cfg, arm, start, rs, *, search, rules=None):
        asked.append(arm)
        return KneeResult(arm.label, {}, arm.batch + (0.5 if arm.gated else 0.0) + arm.wait_ms / 1e4)

    monkeypatch.setattr(knee_mod, "knee", fake_knee)
    got = screen_knees(profiled_workload(10.0), 688.0, 60.0, 2, Opts(time_scale=10.0))
    assert set(asked) == set(screen_arms(10.0))
    assert [c["arm"] for c in got] == ["static:128:500:gate", "static:128:300:gate"]
    assert all(c["gated"] and c["batch"] == 128 for c in got)


def test_static_candidates_run_on_one_fleet_per_formation_the_gated_one_as_the_gated_model(monkeypatch):
    """``run_static`` without Ray: a fake fleet per formation records how it was deployed and pinned."""
    import bench.live_oracle as lo
    from bench.gated_static import GatedStaticModel

    log: list[tuple] = []

    class FakeTarget:
        def __init__(self, tag, model_cls):
            self.tag = tag
            log.append(("deploy", tag, model_cls))

        def set_static(self, pins):
            log.append(("pin", self.tag, *pins["prof"]))

        def delete(self):
            log.append(("delete", self.tag))

    monkeypatch.setattr(lo, "fleet_target", lambda stack, specs, tag, warm, model_cls=None: FakeTarget(tag, model_cls))
    w = profiled_workload(10.0)
    cands = [lo.candidate(Arm("static", 32, 0.0, True)), lo.candidate(Arm("static", 16, 300.0, False))]
    cands.append(lo.candidate(Arm("static", 16, 0.0, True)))
    ran: list[str] = []
    lo.run_static(None, w, 688.0, Opts(time_scale=10.0), cands, lambda st, c: ran.append(f"{st.tag} {c['arm']}"))
    assert ran == ["static static:16:300", "static-gate static:32:0:gate", "static-gate static:16:0:gate"]
    assert log == [
        ("deploy", "static", None),
        ("pin", "static", 16, 300.0),
        ("delete", "static"),
        ("deploy", "static-gate", GatedStaticModel),
        ("pin", "static-gate", 32, 0.0),
        ("pin", "static-gate", 16, 0.0),
        ("delete", "static-gate"),
    ]
