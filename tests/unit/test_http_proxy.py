"""The proxy middleware (gpubroker.deployments.serve.http_proxy) on fake ASGI apps: only empty answers and
plain-text 503s are rewritten; everything else passes through untouched."""

from __future__ import annotations

import asyncio
import json

from gpubroker.deployments.serve.http_proxy import ExplicitErrors, proxy_middlewares


def run(app) -> list[dict]:
    sent: list[dict] = []

    async def send(m):
        sent.append(m)

    async def receive():
        return {"type": "http.disconnect"}

    asyncio.run(ExplicitErrors(app)({"type": "http", "path": "/v1/models/mlp/infer"}, receive, send))
    return sent


def test_a_lost_replica_is_a_json_503_with_retry_after():
    async def silent(scope, receive, send):  # what Ray's proxy does when the replica died
        return None

    start, body = run(silent)
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    assert "lost" in json.loads(body["body"])["detail"] and "retry" in json.loads(body["body"])["detail"]


def test_serve_queue_full_becomes_json_and_keeps_headers():
    async def backpressure(scope, receive, send):
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", b"2")],
            }
        )
        await send({"type": "http.response.body", "body": b"Request dropped due to backpressure"})

    start, body = run(backpressure)
    assert start["status"] == 503 and (b"retry-after", b"2") in start["headers"]
    assert (b"content-type", b"application/json") in start["headers"]
    detail = json.loads(body["body"])["detail"]
    assert "backpressure" in detail and detail.endswith("retry later")


def test_other_answers_pass_through():
    msgs = [
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]},
        {"type": "http.response.body", "body": b"{}"},
    ]

    async def ok(scope, receive, send):
        for m in msgs:
            await send(m)

    assert run(ok) == msgs
    assert len(proxy_middlewares()) == 1
