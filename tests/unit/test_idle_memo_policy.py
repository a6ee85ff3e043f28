"""``decide`` with the idle models' cache (``broker.control.idle_memo``) gives what it gives without it, on
random tick sequences built to hit what the cache must not hide: idle loads repeated while the
clock runs (across idle_hold_s), free memory dipping under the emergency bar and back, replicas
reporting an emergency shrink, busy spells that start and stop anti-oscillation, a price profile
switching its slack, both batch formations and strategies with and without the latency model."""

from __future__ import annotations

import random

import pytest

from broker.control.idle_memo import IdleMemo
from broker.control.policy import decide, initial_state
from broker.wire import FleetSnapshot
from tests.unit.policy_builders import MONDAY_UTC, GiB, gpu, load, make_config, replicas_seen, timings

# calibrated memory (1 GiB of weights, 64 MiB per item): a busy model's plan outgrows its base and borrows
MEMORY = {"weights_bytes": 1 * GiB, "bytes_per_unit": float(64 * 1024**2)}
IDLE = {"replicas": 1, "mem_used_bytes": 1 * GiB, "mem_peak_bytes": 1 * GiB, **MEMORY}


def _loads(rng: random.Random, name: str, busy: bool):
    if not busy:
        # the same idle load over and over (a repeated key), now and then a queue or a shrink report
        return load(
            name,
            **IDLE,
            queue_depth=1.0 if rng.random() < 0.02 else 0.0,
            emergency=rng.random() < 0.02,
            busy_frac=0.5 if rng.random() < 0.02 else 0.0,
        )
    rate = rng.choice([5.0, 40.0, 200.0])
    return load(
        name,
        replicas=1,
        arrival_rate_rps=rate,
        recent_arrival_rate_rps=rate * rng.choice([1.0, 3.0]),
        queue_depth=float(rng.randint(0, 60)),
        p95_ms=rng.uniform(5, 300),
        recent_p95_ms=rng.uniform(5, 300),
        latency_samples=100,
        recent_samples=40,
        batch_timings=timings(5.0, 0.4),
        mem_used_bytes=rng.randint(1, 5) * GiB,
        mem_peak_bytes=5 * GiB,
        busy_frac=rng.uniform(0.1, 0.9),
        **MEMORY,
    )


@pytest.mark.parametrize("seed", range(6))
def test_decide_with_the_memo_equals_decide_without(seed):
    rng = random.Random(seed)
    strategy = ["hybrid", "queue", "aimd", "model"][seed % 4]
    cfg = make_config(
        broker={"batch_formation": "lazy" if seed % 2 else "eager"},
        models={
            "a": {"control": {"strategy": strategy}},
            "b": {"control": {"strategy": strategy}},
        },
        profiles={
            "timezone": "UTC",
            "schedule": [
                {
                    "name": "peak",
                    "days": "mon-sun",
                    "hours": "00:00-00:03",
                    "objective": "throughput",
                    "latency_slack": 1.5,
                },
                {"name": "offpeak", "default": True, "objective": "latency", "latency_slack": 1.0},
            ],
        },
    )
    memo = IdleMemo()
    with_memo = without = initial_state(cfg, cfg.usable_bytes(10 * GiB))
    busy = {"a": False, "b": True}
    now = MONDAY_UTC
    moves = 0
    for step in range(600):
        now += rng.choice([0.5, 1.0, 1.0, 2.0, 7.0])
        for name in busy:
            if rng.random() < 0.04:
                busy[name] = not busy[name]
        free = 0.05 if rng.random() < 0.05 else 0.5
        loads = {}
        for name in busy:
            ld = _loads(rng, name, busy[name])
            loads[name] = ld
        snap = FleetSnapshot(
            now_s=now,
            gpu=gpu(free_frac=free),
            models={
                n: l.__class__(**{**l.__dict__, "replica_reports": replicas_seen(l, now)}) for n, l in loads.items()
            },
        )
        got, with_memo = decide(snap, cfg, with_memo, memo=memo)
        want, without = decide(snap, cfg, without)
        assert got == want, step
        assert with_memo == without, step
        moves += len(got.moves)
    assert moves > 5  # grants moved under cached models (lending, reclaim)
    assert memo.hits >= 5  # the cache answered on this sequence (and agreed each time)
