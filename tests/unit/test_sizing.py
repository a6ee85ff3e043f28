"""The suggested quota's arithmetic (gpubroker.sizing): the model's bytes at three batches, beside
what the replica process holds itself, with the share of the grant a replica keeps free."""

from __future__ import annotations

import pytest

from gpubroker.broker.control.memory_model import MemoryModel
from gpubroker.quotas.config import parse_config_text
from gpubroker.sizing import (
    NO_FOOTPRINT,
    REPLICA_RUNTIME_BYTES,
    Footprint,
    kept_free_frac,
    quota_bytes,
    runtime_bytes_for,
    suggest_quota,
)

MiB = 1024**2
FLEET = """\
gpu: {device: cpu, capacity: 8GiB, emergency_free_frac: EMERGENCY}
models:
  m:
    model: mlp
    quota: {min: 64MiB, base: 128MiB, max: 256MiB}
    batch: {floor: 2, ceiling: 64}
    slo_p95_ms: 100
"""


def fleet(emergency: float = 0.1):
    return parse_config_text(FLEET.replace("EMERGENCY", str(emergency)), "test")


def test_each_size_is_the_footprint_weights_and_batch_over_the_share_kept_free():
    """(8 + 48 + 10 MiB + 1 MiB x b) / 0.9: floor 2 -> 76 MiB (75.6 rounded up), b* = (50 - 5)/0.5 = 90
    -> the ceiling 64 -> 145 MiB (144.4 up)."""
    spec = fleet().models["m"]
    q = suggest_quota(5.0, 0.5, 10 * MiB, 1 * MiB, spec, footprint=Footprint(8 * MiB, 48 * MiB), free_frac=0.1)
    assert (q.batch_at_slo, q.batch_alone) == (64, 64)
    assert q.min_bytes == 76 * MiB and q.base_bytes == q.max_bytes == 145 * MiB
    assert (q.process_bytes, q.runtime_bytes, q.weights_bytes, q.free_frac) == (8 * MiB, 48 * MiB, 10 * MiB, 0.1)


def test_without_a_footprint_or_margin_it_is_the_models_bytes_alone():
    """The old suggestion (the model's own bytes), kept for a card where the context is budgeted apart."""
    spec = fleet().models["m"]
    q = suggest_quota(5.0, 0.5, 64 * MiB, 1 * MiB, spec)
    assert (q.min_bytes, q.base_bytes, q.max_bytes) == (66 * MiB, 128 * MiB, 128 * MiB)


def test_the_readme_scorer_gets_room_for_its_process_not_one_mib():
    """Issue 54: 1.5 KiB of weights and 516 B per request suggested 1 MiB; its replica held 17-40 MiB."""
    spec = fleet().models["m"]
    bare = suggest_quota(0.03, 0.004, 1540, 516, spec)
    q = suggest_quota(0.03, 0.004, 1540, 516, spec, footprint=Footprint(8 * MiB, REPLICA_RUNTIME_BYTES), free_frac=0.1)
    assert bare.base_bytes == 1 * MiB
    held = 8 * MiB + REPLICA_RUNTIME_BYTES + 1540 + 516 * q.batch_at_slo
    assert q.base_bytes >= held / 0.9 and q.base_bytes - held / 0.9 < MiB


@pytest.mark.parametrize("emergency", [0.05, 0.1, 0.3])
def test_the_share_kept_free_is_the_fast_loops_line_or_the_brokers_slack(emergency):
    assert kept_free_frac(fleet(emergency)) == max(emergency, 0.10)


def test_a_grant_sized_so_is_above_the_fast_loops_emergency_line_and_holds_the_batch_for_the_broker():
    """At the suggested grant the replica's free share is at least the emergency line, and the broker's
    memory model (fixed part = footprint + weights) lets that batch run."""
    footprint, weights, per_item = Footprint(7 * MiB + 123, 48 * MiB), 3 * MiB + 7, 40_000.0
    for batch in (1, 2, 17, 64, 500):
        grant = quota_bytes(footprint, weights, per_item, batch, 0.1)
        held = footprint.total_bytes + weights + per_item * batch
        assert 1.0 - held / grant >= 0.1 and grant % MiB == 0
        assert MemoryModel(footprint.total_bytes + weights, per_item).cap_for(grant) >= batch


def test_the_runtime_counts_on_host_memory_only():
    assert runtime_bytes_for("cpu") == REPLICA_RUNTIME_BYTES and runtime_bytes_for("cuda:0") == 0
    assert NO_FOOTPRINT.total_bytes == 0 and Footprint(3, 4).total_bytes == 7


def test_a_share_kept_free_of_one_is_refused():
    with pytest.raises(ValueError, match="free_frac"):
        suggest_quota(1.0, 1.0, 0, 0, fleet().models["m"], free_frac=1.0)
