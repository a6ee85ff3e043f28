"""Benchmarks only: a static-pinned model with the replica's lazy gate in front of Ray's batcher.

A fleet model with ``control.strategy: static`` never uses the gate (``gpubroker.deployments.replica.deployment``);
``bench.ablation_live`` and the live oracles (``bench.live_oracle``) deploy this subclass for
the simulator's ``static:B:W:gate``: the gate exactly as the broker's replicas run it (the next
batch started first included), under a static pin. Nothing else changes.
"""

from __future__ import annotations

from gpubroker.deployments.serve.http_model import HttpModel


class GatedStaticModel(HttpModel):
    GATE_STATIC = True  # the replica keeps its lazy gate (with batch_formation: lazy) under a static pin
