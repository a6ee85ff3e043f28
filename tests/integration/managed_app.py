"""A user's own Ray Serve app under the broker (``tests/integration/test_managed_serve.py``): a
FastAPI ingress calling two deployments of one ``Scorer`` class through ``DeploymentHandle``s,
each put under the broker with ``gpubroker.managed``. ``Scorer`` is plain Ray Serve: a
``@serve.batch`` method that takes ``BATCH_MS`` + ``ITEM_MS`` per item (a sleep: no CPU), and a
``reconfigure`` for its ``user_config``."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

import gpubroker

BATCH_MS = 100.0  # fixed cost of a batch
ITEM_MS = 2.0  # and per item


class Scorer:
    def __init__(self) -> None:
        self.factor = 1.0

    def reconfigure(self, user_config: dict) -> None:
        self.factor = float(user_config.get("factor", 1.0))

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.005)
    async def score(self, xs: list[float]) -> list[float]:
        await asyncio.sleep((BATCH_MS + ITEM_MS * len(xs)) / 1000.0)
        return [x * self.factor for x in xs]


api = FastAPI()


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class Front:
    def __init__(self, busy: DeploymentHandle, idle: DeploymentHandle) -> None:
        self.handles = {"busy": busy, "idle": idle}

    @api.post("/score/{name}")
    async def score(self, name: str, body: dict) -> dict:
        return {"y": await self.handles[name].score.remote(float(body["x"]))}

    @api.get("/managed/{name}")
    async def managed(self, name: str) -> dict:
        return await self.handles[name].gpubroker_status.remote()


def build(config_text: str) -> Application:
    """The app: ``busy`` (user_config factor 2) and ``idle``, both ``Scorer`` under the broker."""
    small = {"max_ongoing_requests": 512, "ray_actor_options": {"num_cpus": 0.1}}  # three replicas on 2 CPUs
    busy = serve.deployment(name="busy", user_config={"factor": 2.0}, **small)(
        gpubroker.managed("busy", config_text=config_text)(Scorer)
    )
    idle = serve.deployment(name="idle", **small)(gpubroker.managed("idle", config_text=config_text)(Scorer))
    return Front.bind(busy.bind(), idle.bind())  # type: ignore[attr-defined]  # Deployment, typed as the class
