"""A static pin with the lazy gate (``bench.gated_static``, the live ``static:B:W:gate`` arm) runs
the gate as the broker's replicas do, next batch first included; a plain static pin runs none.

In-process, Serve's real batcher, the ``profiled`` EMULATION (``tests.unit.test_replica_lazy_formation``).
"""

from __future__ import annotations

import asyncio

from bench.gated_static import GatedStaticModel
from gpubroker.deployments.replica.deployment import ModelReplica
from tests.unit.test_replica_lazy_formation import CONFIG, _replica

STATIC = CONFIG.format(formation="lazy").replace(
    "    slo_p95_ms: 5000\n", "    slo_p95_ms: 5000\n    control: {strategy: static}\n"
)


class GatedStatic(ModelReplica):
    GATE_STATIC = GatedStaticModel.GATE_STATIC


def _built(monkeypatch, tmp_path, cls: type) -> ModelReplica:
    monkeypatch.setattr("tests.unit.test_replica_lazy_formation.ModelReplica", cls)
    r, _ = asyncio.run(_replica(STATIC, monkeypatch, tmp_path / f"{cls.__name__}.json"))
    return r


def test_a_static_pin_runs_no_gate(monkeypatch, tmp_path):
    r = _built(monkeypatch, tmp_path, ModelReplica)
    assert r.spec.control.strategy == "static"
    assert not r.lazy_gate and r.next_start.extra_slots == 0


def test_the_gated_static_model_runs_the_gate_and_starts_the_next_batch_first(monkeypatch, tmp_path):
    r = _built(monkeypatch, tmp_path, GatedStatic)
    assert r.spec.control.strategy == "static"
    assert r.lazy_gate and r.next_start.extra_slots == 1  # Serve's batcher has the slot next-batch-first needs
