"""Memory model per model: weights + bytes per batch unit (request or token).

Calibrated at start-up by the replica (running a few batch sizes and measuring peak memory)
and carried in the snapshot. The batch ceiling from memory is
``cap_mem = (grant_per_replica - weights) / bytes_per_unit``; with no calibration (bytes per
unit 0) memory does not limit the batch.

Every out-of-memory error teaches it at once: a batch of cost ``c`` that ran out of memory
(``ModelLoad.oom_costs``, over the window) caps the ceiling at ``ceil(c) - 1`` below the smallest
such cost, calibrated or not, whatever the grant arithmetic says, so the cap that ran out of
memory is not used again while the OOM is in the window.
"""

from __future__ import annotations

import math
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from gpubroker.broker.control.types import ModelLoad

HEADROOM_FRAC = 0.9  # use at most this share of the grant for weights + batch, the rest is allocator slack


class MemoryModel(NamedTuple):
    """One model's memory: weights and bytes per batch unit (a named tuple: built per model per tick)."""

    weights_bytes: int
    bytes_per_unit: float
    oom_cost: float | None = None  # smallest batch cost that ran out of memory in the window, None: none did

    @classmethod
    def from_load(cls, load: ModelLoad) -> MemoryModel:
        """The calibrated model, refined from live reports: when a replica's peak memory over
        the window, less what its biggest recent batch needs, is above the calibrated weights (allocator
        pools, runtime, fragmentation: on host memory RSS never shrinks back), that observed
        fixed part is used instead, so the batch ceiling and the memory a model asks to borrow
        follow what is measured against its grant."""
        oom = min(load.oom_costs) if load.oom_costs else None
        weights, per_unit = int(load.weights_bytes), float(load.bytes_per_unit)
        if per_unit > 0 and load.mem_peak_bytes > 0 and load.replicas > 0:
            # the biggest batch over the same window as the peak (the fit's recent batches may
            # all be smaller than the one that set the peak: that would inflate the fixed part)
            fit_max = max(map(itemgetter(0), load.batch_timings), default=load.mean_batch)
            biggest = max(load.max_batch, fit_max)
            observed = load.mem_peak_bytes / load.replicas - load.bytes_per_unit * biggest
            if observed > weights:
                weights = int(observed)
        return cls(weights, per_unit, oom)

    @property
    def calibrated(self) -> bool:
        return self.bytes_per_unit > 0

    def bytes_for(self, batch: float) -> int:
        """Memory one replica needs to run a batch of this cost."""
        return int(self.weights_bytes + self.bytes_per_unit * batch)

    def cap_for(self, grant_per_replica_bytes: float) -> int | None:
        """Largest batch that fits the grant and is below every batch that ran out of memory
        (None: unlimited, not calibrated and no OOM)."""
        below_oom = None if self.oom_cost is None else max(0, math.ceil(self.oom_cost) - 1)
        if not self.calibrated:
            return below_oom
        room = grant_per_replica_bytes * HEADROOM_FRAC - self.weights_bytes
        fits = max(0, int(room // self.bytes_per_unit))
        return fits if below_oom is None else min(fits, below_oom)

    def grant_for(self, batch: float) -> int:
        """Grant per replica that lets a batch of this cost run, with the same slack."""
        return int(self.bytes_for(batch) / HEADROOM_FRAC) + 1
