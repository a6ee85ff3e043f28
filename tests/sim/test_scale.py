"""bench/scale.py: the synthetic fleets it times are valid and the run produces its table (no timing asserted)."""

from __future__ import annotations

from bench import scale
from gpubroker.quotas.placement import place_fleet


def test_synthetic_fleets_validate_and_place_one_model_per_card_slot():
    one = scale.synthetic_config(1000)
    assert len(one.models) == 1000 and one.gpus is None
    many = scale.synthetic_config(100, cards=16)
    p = place_fleet(many)
    assert sum(len(plan.models) for plan in p.cards) == 100
    assert {len(plan.models) for plan in p.cards} == {6, 7}  # 100 over 16 cards
    assert all(plan.base_bytes <= plan.usable_bytes for plan in p.cards)


def test_core_runs_on_the_fake_clock_and_ticks_once_per_control_interval():
    cores = scale._Cores(scale.synthetic_doc(10), seed=1)
    runs = cores.run(20.0)
    assert len(runs["tick_ms"]) == 20 and len(runs["report_us"]) == 40
    status = cores.broker.status()
    assert status["ticks"] == 20 and all(m["replicas"] == 1 for m in status["models"].values())


def test_sixteen_cards_run_in_one_fleet_broker_with_a_core_per_card():
    cores = scale._Cores(scale.synthetic_doc(32, cards=16), seed=1)
    cores.run(4.0)
    assert len(cores.broker.cores) == 16
    status = cores.broker.status()
    assert len(status["cards"]) == 16 and all(len(c["models"]) == 2 for c in status["cards"])
    row = scale.bench_cards(16, 32, seconds=2.0)
    assert row["cores"] == 16 and row["ticks"] == 2


def test_table_names_every_case_and_the_one_card_fallback():
    res = {
        "models": [
            {
                "case": "1 card x 10 models",
                "ticks": 3,
                "median_tick_ms": 1.0,
                "p99_tick_ms": 2.0,
                "max_tick_ms": 2.0,
                "report_us": 30.0,
            }
        ],
        "cards": [
            {
                "case": "16 cards x 100 models",
                "cores": 16,
                "ticks": 3,
                "median_tick_ms": 5.0,
                "p99_tick_ms": 9.0,
                "max_tick_ms": 9.0,
                "report_us": 40.0,
            }
        ],
        "sim": {"case": "simulator: 100 models x 1 h trace", "wall_s": 12.0},
    }
    text = scale.table(res)
    assert "| 16 cards x 100 models | 16 | 3 | 5.00 | 9.00 |" in text
    assert "FleetBroker.tick" in text and "12.0 s wall" in text
    assert "Python" not in text  # a run recorded before the interpreter was
    res["python"] = {"version": "3.11.2", "executable": "/usr/bin/python3.11", "build": ["main", "Apr 28 2025"]}
    assert "Python 3.11.2 (/usr/bin/python3.11, build main Apr 28 2025)" in scale.table(res)


def test_unchanged_share_counts_loads_equal_to_the_last_tick_and_restores_the_window():
    import gpubroker.broker.control.window as bw

    fold = bw.ReportWindow._model_load
    share = scale.unchanged_share(models=8, cards=1, seconds=40.0)
    assert bw.ReportWindow._model_load is fold  # put back
    # models busy one 30 s phase in four: some ticks repeat an idle load, busy ones never do
    assert 0.0 < share < 1.0


def test_by_load_times_the_mixed_fleet_and_each_held_state():
    costs = scale.by_load(models=8, cards=2, seconds=4.0)
    assert list(costs) == ["mixed", "busy", "trickle", "idle"]
    assert all(v > 0 for v in costs.values())


def test_a_held_replica_reports_its_state_every_step():
    cores = scale._Cores(scale.synthetic_doc(4), seed=0, held="busy")
    reports = [scale._report(rep, 1.0, step, cores.rng) for rep in cores.replicas for step in (0, 60, 120)]
    assert all(r.queue_depth == 10 for r in reports)  # busy: rate // 4 queued, in every phase
    idle = scale._Cores(scale.synthetic_doc(4), seed=0, held="idle")
    assert all(scale._report(rep, 1.0, 0, idle.rng).arrivals == 0 for rep in idle.replicas)


def test_the_budget_counts_instructions_only_with_valgrind_and_says_when_a_tick_is_over(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda _name: None)  # no valgrind: time share only
    row = {"case": "16 cards x 100 models", "tick_share": 0.012}
    b = scale.tick_budget(row, quick=True, say=lambda _m: None)
    assert b["tick_instructions"] is None and b["within"] is True
    line = scale._budget_line(b)
    assert "not counted (no valgrind)" in line and "1.20 % of the control interval" in line and "within" in line
    over = scale._budget_line({**b, "tick_instructions": 61_000_000, "within": False})
    assert "61.0 M instructions (at most 50 M)" in over and over.endswith("OVER")
    assert scale.tick_budget({**row, "tick_share": 0.06}, quick=True, say=print)["within"] is False
