"""The load matrix (``gpubroker.sim.loads``) and ``python -m bench matrix`` on a tiny size."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from bench import matrix
from bench.cli import app as bench_app
from gpubroker.quotas.config import parse_config
from gpubroker.sim import loads as L

TINY = matrix.Size(20.0, ("one", "staggered"), ("poisson", "onoff"), (0.8,), ((1.0,), (2.0,)))


@pytest.mark.parametrize("process", L.PROCESSES)
def test_every_process_offers_the_level_it_names(process):
    """Each model's arrivals average the rate its level names (the capacity rule), within noise."""
    fleet = L.FLEETS["staggered"]
    duration = 600.0
    times = L.times_for(process, fleet, 0.8, duration, seed=11)
    want = L.rates(fleet, 0.8)
    got = sum(len(t) for t in times.values()) / duration
    assert got == pytest.approx(sum(want.values()), rel=0.15)
    assert all(np.all(np.diff(t) >= 0) and t[-1] < duration for t in times.values())


def test_staggered_bursts_take_turns_and_random_ones_overlap():
    stag = [L.burst_windows("staggered", i, 3, 300.0, 5) for i in range(3)]
    firsts = [w[0][0] for w in stag]
    assert firsts[1] - firsts[0] == pytest.approx(L.SLOT_S) and firsts[2] - firsts[1] == pytest.approx(L.SLOT_S)
    together = [L.burst_windows("together", i, 3, 300.0, 5) for i in range(3)]
    assert together[0] == together[1] == together[2]
    rand = [L.burst_windows("random", i, 3, 300.0, 5) for i in range(3)]
    assert rand[0] != rand[1]


def test_every_base_holds_exactly_its_batch_and_the_card_holds_every_base():
    for fleet in L.FLEETS.values():
        cfg = parse_config(L.fleet_config(fleet))
        usable = cfg.usable_bytes()
        assert sum(m.quota.base for m in cfg.models.values()) <= usable
        for m in fleet.models:
            spec = cfg.models[m.name]
            per = m.item_mib * L.MIB
            assert (spec.quota.base - m.weights_mib * L.MIB) // per == m.batch


def test_fresh_seeds_differ():
    assert L.fresh_seed() != L.fresh_seed()


def test_bench_matrix_cli_writes_the_aggregates_and_the_seeds(tmp_path, monkeypatch):
    """--quick on a tiny size: the JSON's structure, every cell's seed recorded, no per-request records."""
    monkeypatch.setattr(matrix, "QUICK", TINY)
    out = tmp_path / "m"
    res = CliRunner().invoke(bench_app, ["matrix", "--quick", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "matrix.json").read_text())
    assert isinstance(data["root_seed"], int) and data["command"].startswith("python -m bench matrix")
    assert len(data["cells"]) == 4 and data["seeds"] == [c["seed"] for c in data["cells"]]
    assert len(set(data["seeds"])) == 4
    for c in data["cells"]:
        assert set(c["arms"]) == {"broker", "broker-fixed", "fixed-batch", "oracle", "bentoml-adaptive"}
        assert c["arms"]["oracle"]["goodput_rps"] >= c["arms"]["fixed-batch"]["goodput_rps"]
        assert c["broker_vs_fixed"] == pytest.approx(
            c["arms"]["broker"]["goodput_rps"] / c["arms"]["fixed-batch"]["goodput_rps"], abs=1e-3
        )
    assert set(data["targets"]) == set(matrix.TARGETS)
    assert data["distributions"]["broker_vs_fixed"]["n"] == 4
    assert data["capacity"]["fleets"]["one"]["models"]["m0"]["batch_at_base"] == 8
    assert "latency_ms" not in json.dumps(data)  # aggregates only


def test_the_broker_runs_the_batch_its_base_holds_on_the_emulated_card():
    """Saturated (level 1.1), one model whose base holds a batch of exactly 8: the emulated card
    holds the modelled bytes, so the learned slack is nil and the broker's cap reaches 8 (7 while a
    tenth of every grant was kept), with no OOM, and it serves at least the fixed batch's goodput."""
    fleet = L.FLEETS["one"]
    c = matrix.run_cell(fleet, "poisson", 1.1, 4242, TINY)
    assert c["arms"]["broker"]["models"]["m0"]["ooms"] == 0
    assert c["arms"]["broker"]["models"]["m0"]["mean_batch"] > 7.5
    assert c["broker_vs_fixed"] >= 0.98


def test_the_adaptive_batcher_fits_its_batches_and_cancels_what_cannot_make_its_latency():
    """bench.matrix_bento's dispatcher: after a few batches its fit of the batch duration is near
    the profile's (20 ms + 1 ms a request alone on the card), its batches stay within the base's,
    and a request too late for the SLO is cancelled (a timeout), not run."""
    from bench.matrix_bento import Cork, CorkSim
    from gpubroker.sim.engine import SimOptions
    from gpubroker.sim.types import Arm

    fleet = L.FLEETS["one"]
    cfg = parse_config(L.fleet_config(fleet, fixed=True))
    times = L.times_for("gamma:4", fleet, 1.1, 60.0, seed=3)
    cls = type("Cork8", (CorkSim,), {"batches": {"m0": 8}})
    sim = cls(cfg, Arm("static", 1, 10.0), matrix.workload(cfg, times), 60.0, SimOptions(batching="lazy"))
    res = sim.run()
    cork: Cork = sim.cork(sim.replicas[0][0])
    assert cork.o_a == pytest.approx(0.001, rel=0.2) and cork.o_b == pytest.approx(0.020, rel=0.2)
    assert max(n for _m, _t, n, _c, _o in sim.batch_log) <= 8
    assert res.models["m0"].timeouts > 0 and res.models["m0"].ooms == 0
