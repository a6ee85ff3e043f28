"""Built-in models that tag each output with the batch it ran in (bench only).

``TaggedProfiled`` and ``TaggedMiniLm`` are the ``profiled`` and ``minilm`` adapters with one
addition: every output dict carries ``_batch`` (requests in its batch), ``_cost`` (batch cost:
requests, or tokens) and ``_batch_ms`` (the batch's measured predict time), plus wall-clock
stamps for a latency breakdown (``bench.knee_breakdown``): ``_t_val`` (when this request was
validated: in the replica's worker thread for the fleet, inside the batch for BentoML),
``_t0``/``_t1`` (when its batch's predict started and ended; ``time.time()``, one machine). The load
generator reads them from the responses, so the mean batch size and the L(b) = a + c·b fit
come from the live run, identically for every arm (broker, static, plain Serve, BentoML).
Config: ``model: bench.tagged:TaggedProfiled`` with the usual ``profiled`` options.
No ray import here: the BentoML peer loads these too.
"""

from __future__ import annotations

import time

from gpubroker.deployments.models.minilm import MiniLmAdapter
from gpubroker.deployments.models.profiled import ProfiledAdapter


class _Tag:
    def validate(self, item):  # type: ignore[no-untyped-def]
        value = super().validate(item)  # type: ignore[misc]
        return {**value, "_t_val": time.time()} if isinstance(value, dict) else value

    def predict(self, items: list) -> list:  # type: ignore[override]
        w0 = time.time()
        t0 = time.perf_counter()
        out = super().predict(items)  # type: ignore[misc]
        ms = (time.perf_counter() - t0) * 1000.0
        cost = sum(self.cost(item) for item in items)  # type: ignore[attr-defined]
        tag = {"_batch": len(items), "_cost": int(cost), "_batch_ms": round(ms, 3), "_t0": w0, "_t1": w0 + ms / 1000.0}
        return [
            {**o, **tag, "_t_val": it.get("_t_val") if isinstance(it, dict) else None} if isinstance(o, dict) else o
            for o, it in zip(out, items)
        ]


class TaggedProfiled(_Tag, ProfiledAdapter):
    name = "profiled"


class TaggedMiniLm(_Tag, MiniLmAdapter):
    name = "minilm"


TAGGED = {"profiled": "bench.tagged:TaggedProfiled", "minilm": "bench.tagged:TaggedMiniLm"}
