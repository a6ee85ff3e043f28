"""HTTP ingress (FastAPI through ``serve.ingress``) in front of the model deployments.

``POST /v1/models/{name}/infer``  body ``{"inputs": [item, ...]}`` or ``{"input": item}``
    200 ``{"model", "outputs": [...], "latency_ms"}`` (``{"output": ...}`` for a single input)
    404 unknown model (the detail names the known ones)
    413 body over the model's ``max_body_bytes`` (Content-Length, then the bytes read, both
        checked before any JSON parsing)
    422 bad input: the detail names the field (``inputs[2].text``, ``input.image``, ``body``)
    503 + ``Retry-After`` on back-pressure (queue full, admission paused, Serve's queue full)
    504 when a request waited past the model's ``request_timeout_s``
``GET /v1/status``  the broker's ``status()`` (503 when no broker answers)
``GET /v1/decisions?model=&since_seq=``  the broker's decision log
``GET /v1/models``  the model names
"""


import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from quotas.config import parse_config_text

api = FastAPI(title="gpubroker", description="Several Ray Serve models sharing one GPU.")


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body, headers=headers)


@serve.deployment
@serve.ingress(api)
class Ingress:
    def __init__(self, handles: dict[str, Any], config_text: str):
        self.handles = handles
        self.cfg = parse_config_text(config_text, "ingress config")
        self.retry_after_s = max(1, int(round(self.cfg.broker.control_interval_s)))
        self._broker = None
        self._rejected: dict[str, int] = {}  # refused here, not yet reported to the broker
        self._flush_task: asyncio.Task | None = None

    def _count_rejection(self, name: str) -> None:
        self._rejected[name] = self._rejected.get(name, 0) + 1
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_rejections())

    async def _flush_rejections(self) -> None:
        """Every report interval, one RPC with the rejections the ingress made itself, so the
        broker's counts (status, attainment, metrics) include requests no replica saw."""
        import ray

        while self._rejected:
            await asyncio.sleep(self.cfg.broker.report_interval_s)
            counts, self._rejected = self._rejected, {}
            try:
                if self._broker is None:
                    self._broker = ray.get_actor(self.cfg.broker.name, namespace=self.cfg.broker.namespace)
                await asyncio.wait_for(self._broker.report_rejections.remote(counts), timeout=10)
            except Exception:  # noqa: BLE001 - broker away: keep the counts for the next try
                self._broker = None
                for k, v in counts.items():
                    self._rejected[k] = self._rejected.get(k, 0) + v
                await asyncio.sleep(self.retry_after_s)

    def _known(self) -> str:
        return ", ".join(sorted(self.handles))

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"models": sorted(self.handles)}

    @api.post("/v1/models/{name}/infer")
    async def infer(self, name: str, request: Request) -> JSONResponse:
        handle = self.handles.get(name)
        if handle is None:
            return _json(404, {"detail": f"unknown model '{name}'; known models: {self._known()}", "known": sorted(self.handles)})
        limit = int(self.cfg.models[name].max_body_bytes)
        too_big = {"detail": f"body is over max_body_bytes ({limit} bytes) for model '{name}'; send fewer or smaller inputs"}
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > limit:
                    return _json(413, too_big)
            except ValueError:
                return _json(400, {"detail": f"Content-Length {length!r} is not a number"})
        body = bytearray()
        async for chunk in request.stream():  # stop reading as soon as the limit is passed
            body.extend(chunk)
            if len(body) > limit:
                return _json(413, too_big)
        try:
            doc = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _json(422, {"detail": f"body: not valid JSON ({exc}); send {{\"inputs\": [...]}} or {{\"input\": ...}}", "field": "body"})
        single = False
        if not isinstance(doc, dict):
            return _json(422, {"detail": "body: expected a JSON object with 'inputs' (a list) or 'input'", "field": "body"})
        extra = sorted(set(doc) - {"inputs", "input"})
        if extra:
            return _json(422, {"detail": f"{extra[0]}: unknown field; send only 'inputs' (a list) or 'input'", "field": extra[0]})
        if "inputs" in doc and "input" in doc:
            return _json(422, {"detail": "inputs: send either 'inputs' (a list) or 'input' (one item), not both", "field": "inputs"})
        if "inputs" in doc:
            inputs = doc["inputs"]
            if not isinstance(inputs, list) or not inputs:
                return _json(422, {"detail": "inputs: expected a non-empty list of items", "field": "inputs"})
        elif "input" in doc:
            inputs, single = [doc["input"]], True
        else:
            return _json(422, {"detail": "inputs: required field is missing; send {\"inputs\": [...]} or {\"input\": ...}", "field": "inputs"})
        try:
            result = await handle.infer.remote(inputs, len(body))
        except Exception as exc:  # noqa: BLE001 - map Serve's back-pressure and lost replicas, keep anything else a 5xx
            from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
            from ray.serve.exceptions import BackPressureError

            if isinstance(exc, BackPressureError) or "BackPressureError" in type(exc).__name__:
                self._count_rejection(name)
                return _json(503, {"detail": f"model '{name}' is overloaded (Serve queue full); retry later"},
                             {"Retry-After": str(self.retry_after_s)})
            if isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError)):
                # the replica died or is restarting with this request on it: retriable, not a 500
                self._count_rejection(name)
                return _json(503, {"detail": f"model '{name}': the replica serving this request was lost ({type(exc).__name__}); "
                                             "retry, a replacement is starting"},
                             {"Retry-After": str(self.retry_after_s)})
            return _json(500, {"detail": f"model '{name}' failed: {exc!r}"})
        status = int(result.get("status", 500))
        if status == 200:
            if single:
                return _json(200, {"model": name, "output": result["outputs"][0], "latency_ms": result.get("latency_ms")})
            return _json(200, {"model": name, "outputs": result["outputs"], "latency_ms": result.get("latency_ms")})
        body_out = {k: v for k, v in result.items() if k not in ("status", "retry_after_s")}
        if single and "field" in body_out:
            body_out["field"] = str(body_out["field"]).replace("inputs[0]", "input")
            body_out["detail"] = str(body_out["detail"]).replace("inputs[0]", "input")
        headers = None
        if status == 503:
            headers = {"Retry-After": str(result.get("retry_after_s", self.retry_after_s))}
        return _json(status, body_out, headers)

    @api.get("/v1/status")
    async def status(self) -> JSONResponse:
        return await self._ask_broker("status")

    @api.get("/v1/decisions")
    async def decisions(self, model: str | None = None, since_seq: int = 0) -> JSONResponse:
        return await self._ask_broker("decisions", model, since_seq)

    async def _ask_broker(self, method: str, *args: Any) -> JSONResponse:
        import ray

        broker = self.cfg.broker
        for attempt in range(2):
            try:
                if self._broker is None:
                    self._broker = ray.get_actor(broker.name, namespace=broker.namespace)
                ref = getattr(self._broker, method).remote(*args)
                return _json(200, await asyncio.wait_for(ref, timeout=10))
            except Exception as exc:  # noqa: BLE001
                self._broker = None
                if attempt == 1:
                    return _json(503, {"detail": f"broker '{broker.name}' (namespace {broker.namespace}) did not answer: {exc!r}"},
                                 {"Retry-After": str(self.retry_after_s)})
        return _json(503, {"detail": "unreachable"})
