"""A user model that takes what it is sent: ``{"mb": N}`` allocates N MiB per item (a torch
tensor, every page written) and holds it for the whole batch. Imported by path
(``tests.integration.alloc_model:AllocModel``), like an operator's model; it does nothing to
stay inside its grant -- only the replica's limit can hold it."""

from __future__ import annotations

import time

MiB = 1024**2


class AllocModel:
    def __init__(self, hold_ms: float = 50.0, max_mb: int = 4096):
        self.hold_ms = float(hold_ms)
        self.max_mb = int(max_mb)

    def load(self, device: str) -> None:
        self.device = device

    def validate(self, item):
        from gpubroker.deployments.models import InputError

        mb = item.get("mb") if isinstance(item, dict) else None
        if isinstance(mb, bool) or not isinstance(mb, int) or not 0 <= mb <= self.max_mb:
            raise InputError("mb", f"expected an integer in [0, {self.max_mb}], got {mb!r}")
        return {"mb": mb}

    def predict(self, items):
        import torch

        held = [torch.ones(item["mb"] * MiB, dtype=torch.uint8) for item in items]  # ones: every page written
        time.sleep(self.hold_ms / 1000.0)
        return [{"mb": item["mb"], "held_bytes": int(t.numel())} for item, t in zip(items, held)]

    def example_input(self, cost=None):
        return {"mb": 1}
