"""Ablation only: a static-pinned model with the replica's lazy gate in front of Ray's batcher.

A fleet model with ``control.strategy: static`` never uses the gate (``deployments.replica``);
``bench.ablation_live`` deploys this subclass to measure what the gate alone buys a static
setting (the simulator's ``static:B:W:gate``). Nothing else changes.
"""

from __future__ import annotations

from deployments.http_model import HttpModel


class GatedStaticModel(HttpModel):
    async def __init__(self, model_name: str, config_text: str):
        await super().__init__(model_name, config_text)
        self.lazy_gate = self.cfg.broker.batch_formation == "lazy"
