"""A user model that keeps what it allocates: each item adds ``mb_per_item`` MiB (a numpy array,
every page written) to a store it never frees, up to ``max_held_mb``. It declares its memory
model, so the broker sizes it from the start. Imported by path
(``tests.integration.hold_model:HoldModel``), like an operator's model: the borrower that does
not give a reclaimed loan back, whatever its cap, caches or admission say."""

from __future__ import annotations

import time

MiB = 1024**2


class HoldModel:
    def __init__(self, mb_per_item: int = 4, max_held_mb: int = 256, hold_ms: float = 20.0):
        self.mb = int(mb_per_item)
        self.max_held = int(max_held_mb) * MiB
        self.hold_ms = float(hold_ms)
        self.store: list = []

    def load(self, device: str) -> None:
        self.device = device

    def declared_memory(self) -> tuple[int, float]:
        return 8 * MiB, float(self.mb * MiB)

    def predict(self, items):
        import numpy as np

        for _ in items:
            if sum(a.nbytes for a in self.store) + self.mb * MiB <= self.max_held:
                self.store.append(np.ones(self.mb * MiB, dtype=np.uint8))  # ones: every page written
        time.sleep(self.hold_ms / 1000.0)
        held = sum(a.nbytes for a in self.store)
        return [{"held_bytes": held} for _ in items]

    def example_input(self, cost=None):
        return {"x": 1}
