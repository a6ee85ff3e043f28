"""The pure parts of ``python -m bench matrix --live``: seeds, rotation, the live fleet, schedules, aggregates."""

import itertools
import json

import numpy as np
import pytest

from bench import matrix_live as ml
from bench import scenarios as sc
from gpubroker.quotas.config import parse_config_text
from gpubroker.sim import loads as L
from gpubroker.sim.knee import ArmRules


def test_seeds_are_drawn_per_run_and_distinct():
    draws = iter([7, 7, 9, 11])
    assert ml.draw_seeds(3, lambda: next(draws)) == [7, 9, 11]  # a repeat is drawn again
    a, b = ml.draw_seeds(3), ml.draw_seeds(3)
    assert len(set(a)) == 3 and a != b  # fresh from the clock and the OS, never a fixed list


def test_arm_order_rotates_so_each_arm_goes_first_once():
    orders = [ml.rotated(ml.ONE_ARMS, r) for r in range(3)]
    assert [o[0] for o in orders] == list(ml.ONE_ARMS)
    assert all(sorted(o) == sorted(ml.ONE_ARMS) for o in orders)
    assert ml.rotated(ml.CARD_ARMS, 3) == list(ml.CARD_ARMS)


@pytest.mark.parametrize("fleet", ["one", "staggered"])
def test_live_fleet_keeps_the_simulators_batches_and_one_rule(fleet):
    f, k, rules = L.FLEETS[fleet], 10.0, ArmRules()
    arms = {
        "broker": ml.live_models(f, k, rules),
        "fixed": ml.live_models(f, k, rules, fixed=True),
        "static": ml.live_models(f, k, rules, static=True),
    }
    for name, specs in arms.items():
        text = sc.fleet_yaml(specs, broker_name="t", capacity=str(ml.card_bytes(f)))
        cfg = parse_config_text(text, name)  # the live stack accepts it
        for m in f.models:
            s = cfg.models[m.name]
            item = m.item_mib * L.MIB // ml.MEM_SCALE
            weights = m.weights_mib * L.MIB // ml.MEM_SCALE + ml.RUNTIME_BYTES  # the replica's fixed part
            assert (s.quota.base - weights) // item == m.batch  # the base holds B beside it
            assert s.slo_p95_ms == pytest.approx(m.slo_ms(len(f.models)) * k)
            assert s.request_timeout_s == pytest.approx(rules.deadline_s(s.slo_p95_ms))  # every arm's deadline
            assert s.shed_late is False
    static = parse_config_text(sc.fleet_yaml(arms["static"], broker_name="t"), "s").models["m0"]
    assert static.control.strategy == "static" and static.batch.initial == 8 and static.wait.initial_ms == 100.0
    fixed = parse_config_text(sc.fleet_yaml(arms["fixed"], broker_name="t"), "f").models["m0"]
    assert fixed.quota.min == fixed.quota.base == fixed.quota.max
    lend = parse_config_text(sc.fleet_yaml(arms["broker"], broker_name="t"), "b").models["m0"]
    assert lend.quota.max == ml.card_bytes(f)  # lending up to the whole card (one model: its base)


def test_live_times_are_the_simulators_cell_scaled_by_k():
    f = L.FLEETS["one"]
    live = ml.live_times("gamma:4", f, 0.5, 100.0, 42, 10.0)["m0"]
    sim = L.times_for("gamma:4", f, 0.5, 10.0, 42)["m0"]
    np.testing.assert_allclose(live, sim * 10.0)
    assert live.max() < 100.0


def test_staggered_cells_last_a_full_cycle():
    assert ml.FULL.card_duration_s(L.FLEETS["staggered"], 10.0) == L.SLOT_S * 3 * 10.0
    assert ml.FULL.card_duration_s(L.FLEETS["together"], 10.0) == ml.FULL.card_s


def _run(index: int, goodput: dict[str, dict[str, float]]) -> dict:
    cells = []
    for cell, arms in goodput.items():
        part = cell.split("/")[0]
        docs = {a: {"goodput_rps": g} for a, g in arms.items()}
        cells.append({"cell": cell, "part": part, "seed": index, "arms": docs, "ratios": ml.cell_ratios(part, docs)})
    return {"run": index, "seed": index, "arm_order": {}, "cells": cells}


def test_ratios_and_their_distribution_over_runs():
    runs = [
        _run(0, {"one/one/diurnal": {"broker": 11.0, "fixed-batch": 10.0, "bentoml": 10.0}}),
        _run(1, {"one/one/diurnal": {"broker": 12.0, "fixed-batch": 10.0, "bentoml": 8.0}}),
        _run(2, {"one/one/diurnal": {"broker": 9.0, "fixed-batch": 10.0, "bentoml": 10.0}}),
    ]
    s = ml.summarise(runs)
    d = s["distributions"]["per_cell"]["one/one/diurnal"]["broker_vs_bentoml"]
    assert (d["n"], d["min"], d["median"], d["max"]) == (3, 0.9, 1.1, 1.5)
    assert s["targets"]["broker_vs_bentoml_min"] == {"target": 1.1, "value": 0.9, "met": False, "n": 3}
    assert s["targets"]["broker_vs_fixed_min"]["value"] == 0.9


def test_a_failed_arm_leaves_its_ratios_out():
    r = ml.cell_ratios("card", {"broker": {"goodput_rps": 5.0}, "broker-fixed": {"error": "x"}, "fixed-batch": {}})
    assert r == {"broker_vs_fixed": None, "lending_vs_quotas_fixed": None}
    s = ml.summarise([_run(0, {"card/together/onoff": {"broker": 5.0, "broker-fixed": 0.0, "fixed-batch": 4.0}})])
    assert s["distributions"]["overall"]["broker_vs_fixed"]["n"] == 1
    assert s["targets"]["lending_vs_quotas_fixed_min"] == {"target": 1.0, "value": None, "met": False, "n": 0}


def test_result_json_shape_and_table():
    goodput = {
        "one/one/diurnal": {"broker": 11.0, "fixed-batch": 10.0, "bentoml": 10.0},
        "card/staggered/onoff": {"broker": 9.0, "broker-fixed": 8.0, "fixed-batch": 8.0},
    }
    runs = [_run(i, goodput) for i in range(3)]
    res = {"runs": runs, "seeds": [0, 1, 2], "runtime_s": 1.0, **ml.summarise(runs)}
    back = json.loads(json.dumps(res))
    assert set(back["distributions"]["overall"]) == {"broker_vs_fixed", "broker_vs_bentoml", "lending_vs_quotas_fixed"}
    assert set(back["distributions"]["per_cell"]) == set(goodput)
    assert all(set(t) == {"target", "value", "met", "n"} for t in back["targets"].values())
    pairs = itertools.product(range(3), goodput)
    table = ml.table(res)
    assert all(f"| {i} | {i} | {c} |" in table for i, c in pairs)
    assert "| broker_vs_bentoml_min | 1.1 | 1.100 | True |" in table


def test_a_failed_measurement_is_recorded_not_raised():
    class Broken:
        kind = "fleet"

        def idle(self):
            raise RuntimeError("replica gone")

    cell = ml.cells_of(1, ml.QUICK, 10.0)[0]
    doc = ml.measure_or_error(Broken(), cell, ml.QUICK, 10.0, ml.Opts())
    assert set(doc) == {"error"} and "replica gone" in doc["error"]
    assert ml.cell_ratios("one", {"broker": doc, "fixed-batch": {"goodput_rps": 1.0}})["broker_vs_fixed"] is None
