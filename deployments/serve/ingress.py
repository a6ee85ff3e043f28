"""The fleet application: what is not one model's, on Serve's proxy beside the model apps.

Each model is its own Serve application on ``/v1/models/<name>`` (``gpubroker.deployments.serve.http_model``,
one hop from the proxy to the replica); this small app holds the rest of the API and every
path no model app owns (Serve routes by the longest route prefix):

``GET /v1/status``  the broker's ``status()`` (503 + ``Retry-After`` when no broker answers)
``GET /v1/decisions?model=&since_seq=``  the broker's decision log
``GET /v1/models``  the model names; with ``broker.direct_ingress``, each batch model's replica
    URLs under ``direct`` (``gpubroker.deployments.serve.direct_ingress``: read from Serve's controller here,
    never on a model's request path)
``POST /v1/models/{name}/infer`` reaches this app only when no model app owns the path:
    404 for an unknown model (the detail names the known ones); 503 + ``Retry-After`` for a
    model of the config whose application is not routed (starting, or being replaced), and
    those refusals go to the broker (``report_rejections``, one RPC per report interval) so
    its counts include requests no replica saw.

``GET /v1/replicas``  what the replica scaler applied to Serve (``gpubroker.deployments.serve.scaler``).

``POST /v1/embeddings``  OpenAI's embeddings (``gpubroker.deployments.serve.embeddings``): the body
    checked here, the texts run by the model's own app (``HttpModel.embed``: admission, validation,
    the broker's batches, as ``/infer``); an OpenAI client takes ``base_url <fleet url>/v1``.

Its replica also runs the plan follower (``gpubroker.deployments.serve.follow``): a background task that pulls
the broker's ``ServePlan`` and applies it: the replica targets through Serve's external-scaler
API (``app_names``: model -> its Serve app, from ``gpubroker.deployments.app.fleet_api``) and, given a
``reconciler``, the re-placements after a card loss or join.

The broker handle is looked up off the event loop (``asyncio.to_thread``) and kept; every
broker call is awaited with a timeout. Nothing here blocks the loop.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from gpubroker.broker.client import BrokerClient
from gpubroker.deployments.serve.embeddings import (
    body_limit,
    embeddings_body,
    not_an_embedder,
    parse_embeddings,
    replica_error,
    too_large,
)
from gpubroker.deployments.serve.follow import PlanFollower, Reconciler, follow_loop
from gpubroker.deployments.serve.http_api import llm_on_batch_route
from gpubroker.deployments.serve.openai_errors import OpenAIError, overloaded
from gpubroker.deployments.serve.scaler import ReplicaScaler, ServeReplicaSetter
from gpubroker.quotas.config import FleetConfig

api = FastAPI(title="gpubroker", description="Several Ray Serve models sharing one GPU.")

BROKER_RPC_TIMEOUT_S = 10.0


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body, headers=headers)


def _openai(err: OpenAIError) -> JSONResponse:
    return _json(err.status, err.body(), err.headers() or None)


async def read_capped(request: Request, limit_bytes: int) -> bytes | None:
    """The body, or None once it is over ``limit_bytes`` (Content-Length first, then the bytes
    read: reading stops at the limit)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > limit_bytes:
            return None
    return bytes(body)


@serve.deployment
@serve.ingress(api)
class FleetApi:
    def __init__(self, cfg: FleetConfig, app_names: dict[str, str] | None = None, reconciler: Reconciler | None = None):
        """``cfg``: the fleet config as the app builder parsed it (``gpubroker.deployments.app``);
        ``reconciler``: re-placements to Serve (a fleet of many cards deployed by ``gpubroker up``)."""
        self.cfg = cfg
        b = self.cfg.broker
        self.follower = PlanFollower(
            lambda: ray.get_actor(b.name, namespace=b.namespace),
            ReplicaScaler(app_names or {}, ServeReplicaSetter()),
            reconciler,
        )
        self._follow_task: asyncio.Task | None = None
        if app_names or reconciler is not None:
            try:  # Serve runs the constructor on the replica's event loop
                every_s = max(1.0, b.control_interval_s)
                self._follow_task = asyncio.get_running_loop().create_task(follow_loop(self.follower, every_s))
            except RuntimeError:
                self._follow_task = None
        self.names = sorted(self.cfg.models)
        self.app_names = dict(app_names or {})
        self.retry_after_s = max(1, int(round(self.cfg.broker.control_interval_s)))
        self._broker: BrokerClient | None = None
        self._rejected: dict[str, int] = {}  # refused here, not yet reported to the broker
        self._flush_task: asyncio.Task | None = None
        self._app_handles: dict[str, Any] = {}  # a model's Serve app -> its ingress handle (embeddings)

    async def _client(self) -> BrokerClient:
        if self._broker is None:
            b = self.cfg.broker
            handle = await asyncio.to_thread(ray.get_actor, b.name, namespace=b.namespace)
            self._broker = BrokerClient(handle, BROKER_RPC_TIMEOUT_S)
        return self._broker

    def _count_rejection(self, name: str) -> None:
        self._rejected[name] = self._rejected.get(name, 0) + 1
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_rejections())

    async def _flush_rejections(self) -> None:
        """Every report interval, one RPC with the rejections made here."""
        while self._rejected:
            await asyncio.sleep(self.cfg.broker.report_interval_s)
            counts, self._rejected = self._rejected, {}
            try:
                await (await self._client()).report_rejections(counts)
            except Exception:  # noqa: BLE001 - broker away: keep the counts for the next try
                self._broker = None
                for k, v in counts.items():
                    self._rejected[k] = self._rejected.get(k, 0) + v
                await asyncio.sleep(self.retry_after_s)

    @api.get("/v1/replicas")
    async def replicas(self) -> dict[str, Any]:
        return {**self.follower.view(), "running": self._follow_task is not None and not self._follow_task.done()}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        if not self.cfg.broker.direct_ingress:
            return {"models": self.names}
        from gpubroker.deployments.serve.direct_ingress import model_urls, target_groups

        try:
            groups = await target_groups(timeout_s=BROKER_RPC_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the controller away: the names still answer
            return {"models": self.names, "direct": {}, "direct_error": repr(exc)}
        return {"models": self.names, "direct": model_urls(groups, self.app_names, self.cfg.broker.http_host)}

    @api.post("/v1/models/{name}/infer")
    async def infer(self, name: str) -> JSONResponse:
        if name not in self.cfg.models:
            return _json(
                404, {"detail": f"unknown model '{name}'; known models: {', '.join(self.names)}", "known": self.names}
            )
        if self.cfg.models[name].kind == "llm":  # never a batch model: its API is OpenAI's
            llm = llm_on_batch_route(name)
            return _json(llm.status, llm.body)
        self._count_rejection(name)
        return _json(
            503,
            {
                "detail": f"model '{name}' is not serving yet (its application is starting or being "
                "replaced); retry later"
            },
            {"Retry-After": str(self.retry_after_s)},
        )

    @api.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> JSONResponse:
        """OpenAI's embeddings over a model that embeds (``gpubroker.deployments.serve.embeddings``):
        checked here, run by one of the model's replicas on the path ``/infer`` takes."""
        raw = await read_capped(request, body_limit(self.cfg))
        if raw is None:
            return _openai(too_large(body_limit(self.cfg)))
        req = parse_embeddings(raw, self.cfg)
        if isinstance(req, OpenAIError):
            return _openai(req)
        app = self.app_names.get(req.model)
        if app is None:  # a model of the config with no app of its own: the managed path
            return _openai(not_an_embedder(req.model, "is not served by this fleet's model apps"))
        try:
            if app not in self._app_handles:  # the lookup asks Serve's controller: off the event loop, once
                self._app_handles[app] = await asyncio.to_thread(serve.get_app_handle, app)
            result = await self._app_handles[app].embed.remote(req.texts, len(raw))
        except Exception as exc:  # noqa: BLE001 - the app is starting, gone, or its ingress routes cards
            self._app_handles.pop(app, None)
            self._count_rejection(req.model)
            return _openai(
                overloaded(
                    f"model '{req.model}' cannot embed now ({type(exc).__name__}); retry later", self.retry_after_s
                )
            )
        if result.get("status") != 200:
            return _openai(replica_error(req, result))
        return _json(200, embeddings_body(req, result["embeddings"], int(result.get("tokens", 0))))

    @api.get("/v1/status")
    async def status(self) -> JSONResponse:
        return await self._ask_broker(lambda broker: broker.status())

    @api.get("/v1/decisions")
    async def decisions(self, model: str | None = None, since_seq: int = 0) -> JSONResponse:
        return await self._ask_broker(lambda broker: broker.decisions(model, since_seq))

    async def _ask_broker(self, ask: Callable[[BrokerClient], Awaitable[object]]) -> JSONResponse:
        broker = self.cfg.broker
        error: Exception | None = None
        for _ in range(2):  # a stale handle (broker restarted) is looked up once more
            try:
                return JSONResponse(status_code=200, content=await ask(await self._client()))
            except Exception as exc:  # noqa: BLE001
                self._broker, error = None, exc
        return _json(
            503,
            {"detail": f"broker '{broker.name}' (namespace {broker.namespace}) did not answer: {error!r}"},
            {"Retry-After": str(self.retry_after_s)},
        )
