"""``gpubroker.broker.control.tallies.Tallies``: the running sums equal the sums of the tallies in the window."""

from __future__ import annotations

import random

from gpubroker.broker.control.tallies import Tallies, Tally


def test_running_sums_equal_the_window_summed_afresh():
    rng = random.Random(7)
    tallies, t = Tallies(), 0.0
    for _ in range(2000):
        t += rng.uniform(0.0, 1.0)
        tallies.add(Tally(t, rng.randint(0, 50), rng.randint(0, 5)))
        tallies.evict_older(t + rng.uniform(0.0, 2.0), rng.choice((5.0, 30.0)))
        assert tallies.completions == sum(x.completions for x in tallies.items)
        assert tallies.misses == sum(x.misses for x in tallies.items)
    tallies.evict_older(t + 100.0, 30.0)
    assert not tallies.items and tallies.completions == tallies.misses == 0
