"""The model deployment as its own HTTP ingress: one hop from Serve's proxy to the replica.

``HttpModel`` is ``ModelReplica`` (the Serve glue: admission, validation, batching, broker
link) plus a plain ``__call__(request)``: Serve's proxy routes ``/v1/models/<name>`` (the
model's own application, see ``gpubroker.deployments.app``) straight to a replica of the model, and the
request is read, checked and answered in the replica process. No FastAPI, no second
deployment, no Ray call on the request path other than Serve's own body stream.

In order: the path (``POST .../infer``), the body size (Content-Length, then the bytes read,
both before any JSON parsing), the body's shape (``gpubroker.deployments.serve.http_api``), then
``ModelReplica.infer`` (admission, then validation, then the batcher). Answers are built by
``gpubroker.deployments.serve.http_api``. As before the one hop, a 413 or a malformed body is the client's
error, not a miss: only the replica's own refusals (queue full, paused) reach its stats.

``embed`` is the same path for ``POST /v1/embeddings`` (``gpubroker.deployments.serve.embeddings``),
which the fleet API calls with the request's texts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpubroker.deployments.replica.deployment import ModelReplica, batch_failure_detail
from gpubroker.deployments.serve.http_api import (
    JSON_TYPE,
    HttpAnswer,
    ParsedBody,
    answer_for,
    length_check,
    method_not_allowed,
    not_found,
    parse_body,
    too_big,
)

logger = logging.getLogger("ray.serve")


async def read_infer_request(request: Request, name: str, limit: int) -> tuple[ParsedBody, bytes] | HttpAnswer:
    """``POST .../infer`` read and checked in order: the path, the method, the body size
    (Content-Length, then the bytes read, before any JSON parsing), the body's shape. The parsed
    body and its bytes, or the answer that refuses it."""
    scope = request.scope
    sub = scope.get("path", "")[len(scope.get("root_path", "")) :]
    if sub.rstrip("/") != "/infer":
        return not_found(scope.get("path", ""))
    if request.method != "POST":
        return method_not_allowed(request.method)
    early = length_check(name, request.headers.get("content-length"), limit)
    if early is not None:
        return early
    body = bytearray()
    async for chunk in request.stream():  # stop reading as soon as the limit is passed
        body.extend(chunk)
        if len(body) > limit:
            return too_big(name, limit)
    parsed = parse_body(bytes(body))
    return (parsed, bytes(body)) if isinstance(parsed, ParsedBody) else parsed


def _response(answer: HttpAnswer) -> Response:
    try:
        body = answer.encoded()
    except (TypeError, ValueError) as exc:  # never Serve's plain-text 500: say what could not be encoded
        answer = HttpAnswer(500, {"detail": f"the answer could not be encoded as JSON: {exc}"})
        body = answer.encoded()
    return Response(body, status_code=answer.status, headers=answer.headers or None, media_type=JSON_TYPE)


class HttpModel(ModelReplica):
    """One replica of one model, answering ``POST /v1/models/<name>/infer`` itself."""

    async def __call__(self, request: Request) -> Response:
        return _response(await self.answer(request))

    @property
    def retry_after_s(self) -> int:
        return max(1, int(round(self.cfg.broker.control_interval_s)))

    async def answer(self, request: Request) -> HttpAnswer:
        read = await read_infer_request(request, self.name, int(self.spec.max_body_bytes))
        if isinstance(read, HttpAnswer):
            return read
        parsed, body = read
        try:
            result = await self.infer(parsed.inputs, len(body))
        except Exception as exc:  # noqa: BLE001 - a 500 that says what failed, not Serve's bare one
            logger.exception("gpubroker replica %s: request failed", self.name)
            return HttpAnswer(500, {"detail": batch_failure_detail(self.name, exc)})  # its type, not its text
        return answer_for(self.name, result, parsed.single, self.retry_after_s)

    async def embed(self, texts: list[str], body_bytes: int = 0) -> dict[str, Any]:
        """``POST /v1/embeddings`` (the fleet API calls it): ``texts`` become the model's items
        (``embedding_input``) and take ``infer``'s path (admission, validation, the batches);
        ``{"status": 200, "embeddings": [[...]], "tokens"}`` or ``infer``'s error dict (400 with
        ``field: model`` when the model does not embed). ``tokens``: the items' cost when the model
        is token-priced, else 0."""
        adapter = self.adapter
        if not adapter.embeds():
            return {"status": 400, "field": "model", "detail": f"model '{self.name}' does not embed text"}
        items = await asyncio.to_thread(lambda: [adapter.embedding_input(t) for t in texts])
        result = await self.infer(items, body_bytes)
        if result.get("status") != 200:
            return result
        try:
            vectors = await asyncio.to_thread(lambda: [adapter.embedding(out) for out in result["outputs"]])
        except ValueError as exc:  # the model's output holds no vector: its author's fix, named
            return {"status": 500, "detail": str(exc)}
        tokens = int(result.get("cost", 0)) if self.token_priced else 0
        return {"status": 200, "embeddings": vectors, "tokens": tokens}
