"""The overhead baseline: plain Ray Serve ``@serve.batch``, no broker (BENCHMARK.md, "Overhead").

Same shape as the gpubroker fleet so the comparison is like for like: the Serve HTTP proxy,
one FastAPI ingress replica on the same route (``POST /v1/models/{name}/infer``) and one
model replica running the same adapter (``gpubroker.deployments.models.load_adapter``) with Ray's own
``@serve.batch`` at a fixed ``max_batch_size`` / ``batch_wait_timeout_s``; same logical CPUs
as ``gpubroker.deployments.app``. What it lacks is everything gpubroker adds: admission and input
checks, reports to the broker, the fast loop, OOM split-retry.

``set_batch`` changes the setting live (for grids without a redeploy). ``build_plain_one_hop``
is the same ``@serve.batch`` replica answering HTTP itself (one hop, like the fleet's models
since ``gpubroker.deployments.serve.http_model``); ``bench/cost_per_request.py`` measures both shapes.
"""

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

plain_api = FastAPI(title="plain Ray Serve baseline")


class PlainModel:
    def __init__(self, model_ref: str, options: dict[str, Any], batch: int, wait_ms: float):
        from gpubroker.deployments.models import load_adapter

        self.adapter = load_adapter(model_ref, options, "cpu")
        self.token_priced = getattr(self.adapter, "cost_unit", "requests") == "tokens"
        self._batch = serve.batch(
            max_batch_size=int(batch),
            batch_wait_timeout_s=float(wait_ms) / 1000.0,
            batch_size_fn=(lambda items: sum(c for _, c in items)) if self.token_priced else None,
        )(self._run)

    async def _run(self, items: list) -> list:
        return await asyncio.to_thread(self.adapter.predict, [v for v, _ in items])

    async def infer(self, inputs: list) -> list:
        items = []
        for raw in inputs:
            value = self.adapter.validate(raw)
            items.append((value, max(1, int(self.adapter.cost(value))) if self.token_priced else 1))
        return list(await asyncio.gather(*(self._batch(it) for it in items)))

    async def set_batch(self, batch: int, wait_ms: float) -> None:
        self._batch.set_max_batch_size(int(batch))
        self._batch.set_batch_wait_timeout_s(float(wait_ms) / 1000.0)


@serve.deployment
@serve.ingress(plain_api)
class PlainIngress:
    def __init__(self, handle: Any, name: str):
        self.handle = handle
        self.name = name

    @plain_api.post("/v1/models/{name}/infer")
    async def infer(self, name: str, request: Request) -> JSONResponse:
        if name != self.name:
            return JSONResponse(status_code=404, content={"detail": f"unknown model '{name}'; known: {self.name}"})
        doc = json.loads(await request.body())
        single = "input" in doc
        inputs = [doc["input"]] if single else doc["inputs"]  # {"inputs": [...]} as the fleet ingress
        outputs = await self.handle.infer.remote(inputs)
        if single:
            return JSONResponse(content={"model": name, "output": outputs[0]})
        return JSONResponse(content={"model": name, "outputs": outputs})


def build_plain(model_ref: str, options: dict[str, Any], batch: int, wait_ms: float, name: str):
    """The baseline app: ingress + one ``@serve.batch`` replica (logical CPUs as gpubroker.deployments.app)."""
    from gpubroker.deployments.app import INGRESS_NUM_CPUS, MODEL_NUM_CPUS

    model = (
        serve.deployment(PlainModel)
        .options(
            name=name,
            num_replicas=1,
            max_ongoing_requests=max(4096, int(batch) * 2),
            ray_actor_options={"num_cpus": MODEL_NUM_CPUS},
        )
        .bind(model_ref, options, batch, wait_ms)
    )
    return PlainIngress.options(
        name="ingress", ray_actor_options={"num_cpus": INGRESS_NUM_CPUS}, max_ongoing_requests=4096
    ).bind(model, name)


class PlainHttpModel(PlainModel):
    """Plain Serve in one hop, as a Serve user writes it: the ``@serve.batch`` deployment answers
    HTTP itself (``__call__``), routed at ``/v1/models/<name>``: the like-for-like baseline of
    the one-hop fleet (``gpubroker.deployments.serve.http_model``), without its checks, reports and gate."""

    def __init__(self, model_ref: str, options: dict[str, Any], batch: int, wait_ms: float, name: str):
        super().__init__(model_ref, options, batch, wait_ms)
        self.name = name

    async def __call__(self, request: Request) -> JSONResponse:
        doc = json.loads(await request.body())
        single = "input" in doc
        outputs = await self.infer([doc["input"]] if single else doc["inputs"])
        if single:
            return JSONResponse(content={"model": self.name, "output": outputs[0]})
        return JSONResponse(content={"model": self.name, "outputs": outputs})


def build_plain_one_hop(model_ref: str, options: dict[str, Any], batch: int, wait_ms: float, name: str):
    """The one-hop baseline app (deploy it at route prefix ``/v1/models/<name>``)."""
    from gpubroker.deployments.app import MODEL_NUM_CPUS

    return (
        serve.deployment(PlainHttpModel)
        .options(
            name=name,
            num_replicas=1,
            max_ongoing_requests=max(4096, int(batch) * 2),
            ray_actor_options={"num_cpus": MODEL_NUM_CPUS},
        )
        .bind(model_ref, options, batch, wait_ms, name)
    )
