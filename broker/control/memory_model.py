"""Memory model per model: weights + bytes per batch unit (request or token).

Calibrated at start-up by the replica (running a few batch sizes and measuring peak memory)
and carried in the snapshot. The batch ceiling from memory is
``cap_mem = (grant_per_replica - weights) / bytes_per_unit``; with no calibration (bytes per
unit 0) memory does not limit the batch.

The grant is not all usable: an allocator holds more than the bytes a model asks for (a GPU's
caching allocator rounds and fragments; on the emulated card it holds exactly the modelled
bytes). That slack is learned, not assumed: ``slack_frac`` is the share of what a replica
really held at its peak over the window beyond the modelled bytes of the biggest batch behind
that peak (``measured_slack``), at most ``SLACK_MAX``; until a replica has reported a peak
that holds that batch it is ``SLACK_UNMEASURED``. Both are a tenth of every grant: unmeasured,
or where a replica holds a tenth more than modelled, the ceiling keeps that tenth free; where it
holds exactly the modelled bytes, a grant sized for a batch holds that batch. A real slack
above the bound is caught by the OOM ceiling below.

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

SLACK_UNMEASURED = 0.10  # share of the grant kept for allocator slack until a replica reports its memory
SLACK_MAX = 0.10  # the most a measured slack keeps (a larger real one is caught by the OOM ceiling)
MATCH_REL = 1e-6  # a peak this close under the modelled bytes is the same bytes (reports round to whole bytes)


def measured_slack(held_bytes: float, modelled_bytes: float) -> float:
    """Share of what a replica held at its peak beyond the modelled bytes of the batch behind it,
    at most ``SLACK_MAX``. A peak below those bytes measures no slack (the peak and that batch
    did not meet in the window, or the calibration overstates the model): ``SLACK_UNMEASURED``."""
    if held_bytes <= 0 or held_bytes < modelled_bytes * (1.0 - MATCH_REL):
        return SLACK_UNMEASURED
    return min(SLACK_MAX, max(0.0, (held_bytes - modelled_bytes) / held_bytes))


class MemoryModel(NamedTuple):
    """One model's memory: weights and bytes per batch unit (a named tuple: built per model per tick)."""

    weights_bytes: int
    bytes_per_unit: float
    oom_cost: float | None = None  # smallest batch cost that ran out of memory in the window, None: none did
    slack_frac: float = SLACK_UNMEASURED  # share of a grant the allocator's slack takes (module docstring)

    @classmethod
    def from_load(cls, load: ModelLoad) -> MemoryModel:
        """The calibrated model, refined from live reports: when a replica's peak memory over
        the window, less what its biggest recent batch needs, is above the calibrated weights (allocator
        pools, runtime, fragmentation: on host memory RSS never shrinks back), that observed
        fixed part is used instead, so the batch ceiling and the memory a model asks to borrow
        follow what is measured against its grant. The same peak, against the modelled bytes of the
        window's biggest batch, gives the allocator's slack (``measured_slack``)."""
        oom = min(load.oom_costs) if load.oom_costs else None
        weights, per_unit = int(load.weights_bytes), float(load.bytes_per_unit)
        slack = SLACK_UNMEASURED
        if per_unit > 0 and load.mem_peak_bytes > 0 and load.replicas > 0:
            # the biggest batch over the same window as the peak (the fit's recent batches may
            # all be smaller than the one that set the peak: that would inflate the fixed part)
            fit_max = max(map(itemgetter(0), load.batch_timings), default=load.mean_batch)
            biggest = max(load.max_batch, fit_max)
            held = load.mem_peak_bytes / load.replicas
            slack = measured_slack(held, weights + per_unit * load.max_batch)
            observed = held - load.bytes_per_unit * biggest
            if observed > weights:
                weights = int(observed)
        return cls(weights, per_unit, oom, slack)

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
        room = grant_per_replica_bytes * (1.0 - self.slack_frac) - self.weights_bytes
        fits = max(0, int(room // self.bytes_per_unit))
        return fits if below_oom is None else min(fits, below_oom)

    def grant_for(self, batch: float) -> int:
        """Grant per replica that lets a batch of this cost run, with the same slack."""
        return int(self.bytes_for(batch) / (1.0 - self.slack_frac)) + 1
