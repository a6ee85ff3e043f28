"""bench lending's independent load: what the broker with quotas fixed does that the static split does not.

On this card every model's base holds a batch of 5, the static cap; the batch rules hold the
memory ceiling (5) throughout, so what is left to differ is the wait timeout and where the gate's
wait window starts. Pin both to the static split's and the broker-fixed arm serves exactly the
requests the static split serves (``bench.lending_gap``, which measures the rest on 600 s loads).
"""

from __future__ import annotations

import numpy as np

from bench import lending as L
from bench import lending_gap as G


def test_batch_of_is_the_last_batch_started_before_done():
    starts = np.array([0.0, 1.0, 2.0])
    done = np.array([0.5, 1.5, 2.5, 1.0, 2.0 + 1e-6])
    assert G.batch_of(starts, done).tolist() == [0, 1, 2, 0, 2]


def test_broker_fixed_runs_the_memory_ceiling_and_differs_from_static_only_by_its_wait():
    res = G.per_request(1, duration_s=120.0)
    for row in res.values():
        assert row["caps_run"] == {"static-split": [L.STATIC_CAP], "broker-fixed": [L.STATIC_CAP]}
        assert row["broker_wait_ms"][1] > 10.0  # the lazy plan's wait, longer than the static 10 ms


def test_broker_fixed_with_the_static_wait_and_window_is_the_static_split():
    times = L.independent(L.IND_MEAN_RPS, 120.0, 1)
    static = L.run_arm(L.fleet(fixed=True), f"static:{L.STATIC_CAP}:10", times, 120.0, 10.0)
    pinned = L.run_arm(G.fixed_wait(L.fleet(fixed=True), 10.0), "broker", times, 120.0, 10.0, sim_cls=G.OldestWindowSim)
    plain = L.run_arm(L.fleet(fixed=True), "broker", times, 120.0, 10.0)
    for m in L.MODELS:
        assert pinned["models"][m]["attainment"] == static["models"][m]["attainment"]
    # the broker's own wait (and the live gate's window) do move requests across the SLO
    assert any(plain["models"][m]["attainment"] != static["models"][m]["attainment"] for m in L.MODELS)
