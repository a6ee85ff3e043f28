"""A user model that takes what it is sent, on its CUDA device: ``{"mb": N}`` allocates N MiB per
item (a tensor on the replica's device, every byte written) and holds it for the whole batch.
The CUDA twin of ``tests.integration.alloc_model`` (its validation and example input): it does
nothing to stay inside its grant, so only the replica's limit
(``torch.cuda.set_per_process_memory_fraction``) can hold it. Each answer carries
``torch.cuda.max_memory_reserved()``: the process's peak so far."""

from __future__ import annotations

import time

from tests.integration.alloc_model import AllocModel

MiB = 1024**2


class CudaAllocModel(AllocModel):
    def predict(self, items):
        import torch

        held = [torch.ones(item["mb"] * MiB, dtype=torch.uint8, device=self.device) for item in items]
        torch.cuda.synchronize()
        time.sleep(self.hold_ms / 1000.0)
        # the most torch's allocator has reserved in this process so far: what the grant must hold
        peak = int(torch.cuda.max_memory_reserved(self.device))
        return [
            {"mb": item["mb"], "held_bytes": int(t.numel()), "device": str(t.device), "peak_reserved_bytes": peak}
            for item, t in zip(items, held)
        ]
