"""A model placed on several cards: one Serve deployment per card, one HTTP front for all.

Ray Serve gives every replica of a deployment the same resources, and a replica must ask for
its card's resource (``deployments.placement_resources``), so a model on two cards is two
deployments (``<model>@<card>``). Its HTTP front (``CardRouter``, the model application's
ingress) reads and checks the request exactly as a one-card model does
(``deployments.http_model.read_infer_request``: path, size, body), then sends it to the group with the fewest
requests in flight from this router, weighted by the group's replicas, through Serve's
handles (async: no blocking Ray call). That is one hop more than a one-card model; a model on
one card keeps its one hop (``deployments.http_model.HttpModel``).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from deployments.http_api import JSON_TYPE, HttpAnswer, answer_for
from deployments.http_model import read_infer_request
from quotas.config import parse_config_text


def pick_group(in_flight: dict[str, int], replicas: dict[str, int]) -> str:
    """The card group with the fewest in-flight requests per replica (ties: the first card)."""
    return min(in_flight, key=lambda cid: (in_flight[cid] / max(1, replicas[cid]), list(in_flight).index(cid)))


class CardRouter:
    """HTTP front of one model placed on several cards (Serve deployment, the app's ingress)."""

    def __init__(self, model: str, config_text: str, groups: dict[str, Any], replicas: dict[str, int]):
        cfg = parse_config_text(config_text, "card router config")
        self.name = model
        self.spec = cfg.models[model]
        self.retry_after_s = max(1, int(round(cfg.broker.control_interval_s)))
        self.groups = groups  # card id -> DeploymentHandle of that card's group
        self.replicas = dict(replicas)
        self.in_flight = {cid: 0 for cid in groups}

    async def __call__(self, request: Request) -> Response:
        answer = await self.answer(request)
        return Response(
            answer.encoded(), status_code=answer.status, headers=answer.headers or None, media_type=JSON_TYPE
        )

    async def answer(self, request: Request) -> HttpAnswer:
        read = await read_infer_request(request, self.name, int(self.spec.max_body_bytes))
        if isinstance(read, HttpAnswer):
            return read
        parsed, body = read
        cid = pick_group(self.in_flight, self.replicas)
        self.in_flight[cid] += 1
        try:
            result = await self.groups[cid].infer.remote(parsed.inputs, len(body))
        except Exception as exc:  # noqa: BLE001 - the group is gone (node lost): an explicit, retryable answer
            return HttpAnswer(
                503,
                {"detail": f"model '{self.name}' on card {cid} is unavailable ({type(exc).__name__}); retry later"},
                {"Retry-After": str(self.retry_after_s)},
            )
        finally:
            self.in_flight[cid] -= 1
        return answer_for(self.name, result, parsed.single, self.retry_after_s)
