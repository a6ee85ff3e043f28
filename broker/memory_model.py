"""Memory model per model: weights + bytes per batch unit (request or token).

Calibrated at start-up by the replica (running a few batch sizes and measuring peak memory)
and carried in the snapshot. The batch ceiling from memory is
``cap_mem = (grant_per_replica - weights) / bytes_per_unit``; with no calibration (bytes per
unit 0) memory does not limit the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

HEADROOM_FRAC = 0.9  # use at most this share of the grant for weights + batch, the rest is allocator slack


@dataclass(frozen=True)
class MemoryModel:
    weights_bytes: int
    bytes_per_unit: float

    @property
    def calibrated(self) -> bool:
        return self.bytes_per_unit > 0

    def bytes_for(self, batch: float) -> int:
        """Memory one replica needs to run a batch of this cost."""
        return int(self.weights_bytes + self.bytes_per_unit * batch)

    def cap_for(self, grant_per_replica_bytes: float) -> int | None:
        """Largest batch that fits the grant (None: unlimited, not calibrated)."""
        if not self.calibrated:
            return None
        room = grant_per_replica_bytes * HEADROOM_FRAC - self.weights_bytes
        return max(0, int(room // self.bytes_per_unit))

    def grant_for(self, batch: float) -> int:
        """Grant per replica that lets a batch of this cost run, with the same slack."""
        return int(self.bytes_for(batch) / HEADROOM_FRAC) + 1
