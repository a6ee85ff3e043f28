"""A static arm of the simulator whose batch is set per model (``bench.matrix``'s fixed batch and
oracle grid: each model at a share of the batch its own base holds)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from gpubroker.broker.wire import ModelSettings
from gpubroker.sim.engine import Simulator


class PerModelStatic(Simulator):
    """The simulator's static arm sets one batch for every model; this one takes ``batches`` per model."""

    batches: Mapping[str, int] = {}

    def _static_settings(self, name: str) -> ModelSettings:
        return replace(super()._static_settings(name), max_batch_size=self.batches[name])
