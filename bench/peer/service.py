"""The peer arm: the same adapter served by BentoML's adaptive batching.

Runs in its own virtualenv (``bench/peer/.venv-bentoml``; BentoML's pins may clash with
Ray's) as ``bentoml serve bench.peer.service:Peer --port PORT`` with the repository on
PYTHONPATH. Configured by environment variables, read at import:

- ``PEER_MODEL_REF``: adapter import path (``bench.tagged:TaggedProfiled``)
- ``PEER_OPTIONS``: the adapter's options as JSON
- ``PEER_NAME``: model name in the route, ``POST /v1/models/{PEER_NAME}/infer``
- ``PEER_MAX_BATCH``, ``PEER_MAX_LATENCY_MS``: ``@bentoml.api(batchable=True, max_batch_size=...,
  max_latency_ms=...)``

Body ``{"inputs": [item, ...]}`` (the fleet's ingress takes the same); BentoML merges the
``inputs`` lists of concurrent requests into one batch, its dispatcher sizing batches
adaptively from a fitted ``duration = a·n + b`` within ``max_latency_ms``.
"""

from __future__ import annotations

import json
import os

import bentoml

from gpubroker.deployments.models import load_adapter

MODEL_REF = os.environ.get("PEER_MODEL_REF", "bench.tagged:TaggedProfiled")
OPTIONS = json.loads(os.environ.get("PEER_OPTIONS", "{}"))
NAME = os.environ.get("PEER_NAME", "prof")
MAX_BATCH = int(os.environ.get("PEER_MAX_BATCH", "128"))
MAX_LATENCY_MS = int(float(os.environ.get("PEER_MAX_LATENCY_MS", "1000")))


@bentoml.service(workers=1, traffic={"timeout": 60, "max_concurrency": 4096})
class Peer:
    def __init__(self) -> None:
        self.adapter = load_adapter(MODEL_REF, OPTIONS, "cpu")

    @bentoml.api(
        route=f"/v1/models/{NAME}/infer", batchable=True, max_batch_size=MAX_BATCH, max_latency_ms=MAX_LATENCY_MS
    )
    def infer(self, inputs: list[dict]) -> list[dict]:
        items = [self.adapter.validate(x) for x in inputs]
        return self.adapter.predict(items)
