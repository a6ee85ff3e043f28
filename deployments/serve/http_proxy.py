"""A pure ASGI middleware for Serve's HTTP proxy: every refusal the proxy makes itself is an
explicit, retriable JSON answer, as when a gpubroker deployment stood between proxy and model.

With one hop (proxy -> model replica) two answers come from Ray's proxy, not from our code:

- the replica died with the request on it (killed, node lost): Ray's proxy sends nothing and
  the HTTP server answers a bare 500. Here: 503 + ``Retry-After`` and a JSON detail saying the
  replica was lost and a replacement is starting;
- Serve's own queue is full (``max_queued_requests``, a safety net far above the replica's
  ``max_queued``): a plain-text 503. Here: the same status and headers, a JSON ``detail``
  that says to retry.

Installed through Ray's hook ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (``PROXY_ENV``),
which the proxy reads when it starts: whoever starts Ray for a fleet (``gpubroker up``'s local
head, the bench stack) puts it in the environment. Without it Serve's own answers stand.
Not on the success path's cost: one wrapped ``send`` per message, no body buffering.
"""

from __future__ import annotations

import json
from typing import Any

PROXY_CALLBACK = "gpubroker.deployments.serve.http_proxy:proxy_middlewares"
PROXY_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": PROXY_CALLBACK}
RETRY_AFTER_S = 1


def _json_messages(status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    data = json.dumps(body, separators=(",", ":")).encode()
    kept = [(k, v) for k, v in headers if k.lower() not in (b"content-type", b"content-length")]
    return [
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*kept, (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        },
        {"type": "http.response.body", "body": data},
    ]


class ExplicitErrors:
    """Wraps the proxy's ASGI app; only an empty answer or a plain-text 503 is rewritten."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        started = False
        held: dict[str, Any] | None = None  # a plain-text 503's start, until its body arrives
        path = scope.get("path", "")

        async def watch(message: dict[str, Any]) -> None:
            nonlocal started, held
            kind = message["type"]
            if kind == "http.response.start":
                started = True
                headers = message.get("headers") or []
                ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if message.get("status") == 503 and not ctype.startswith(b"application/json"):
                    held = message
                    return
            elif kind == "http.response.body" and held is not None:
                text = bytes(message.get("body") or b"").decode("utf-8", "replace").strip() or "Service unavailable"
                for m in _json_messages(503, {"detail": f"{path}: {text}; retry later"}, held.get("headers") or []):
                    await send(m)
                held = None
                return
            await send(message)

        await self.app(scope, receive, watch)
        if not started:
            body = {"detail": f"{path}: the replica serving this request was lost; retry, a replacement is starting"}
            for m in _json_messages(503, body, [(b"retry-after", str(RETRY_AFTER_S).encode())]):
                await send(m)


def proxy_middlewares() -> list:
    """The callback Ray's proxy imports (``PROXY_CALLBACK``)."""
    from starlette.middleware import Middleware

    return [Middleware(ExplicitErrors)]
