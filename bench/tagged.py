"""Built-in models that tag each output with the batch it ran in (bench only).

``TaggedProfiled`` and ``TaggedMiniLm`` are the ``profiled`` and ``minilm`` adapters with one
addition: every output dict carries ``_batch`` (requests in its batch), ``_cost`` (batch cost:
requests, or tokens) and ``_batch_ms`` (the batch's measured predict time). The load
generator reads them from the responses, so the mean batch size and the L(b) = a + c·b fit
come from the live run, identically for every arm (broker, static, plain Serve, BentoML).
Config: ``model: bench.tagged:TaggedProfiled`` with the usual ``profiled`` options.
No ray import here: the BentoML peer loads these too.
"""

from __future__ import annotations

import time

from deployments.models.minilm import MiniLmAdapter
from deployments.models.profiled import ProfiledAdapter


class _Tag:
    def predict(self, items: list) -> list:  # type: ignore[override]
        t0 = time.perf_counter()
        out = super().predict(items)  # type: ignore[misc]
        ms = (time.perf_counter() - t0) * 1000.0
        cost = sum(self.cost(item) for item in items)  # type: ignore[attr-defined]
        tag = {"_batch": len(items), "_cost": int(cost), "_batch_ms": round(ms, 3)}
        return [{**o, **tag} if isinstance(o, dict) else o for o in out]


class TaggedProfiled(_Tag, ProfiledAdapter):
    name = "profiled"


class TaggedMiniLm(_Tag, MiniLmAdapter):
    name = "minilm"


TAGGED = {"profiled": "bench.tagged:TaggedProfiled", "minilm": "bench.tagged:TaggedMiniLm"}
