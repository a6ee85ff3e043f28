"""A model placed on several cards: one Serve deployment per card, one HTTP front for all.

Ray Serve gives every replica of a deployment the same resources, and a replica must ask for
its card's resource (``gpubroker.deployments.serve.placement_resources``), so a model on two cards is two
deployments (``<model>@<card>``). Its HTTP front (``CardRouter``, the model application's
ingress) reads and checks the request exactly as a one-card model does
(``gpubroker.deployments.serve.http_model.read_infer_request``: path, size, body), then sends it to the group with the fewest
requests in flight from this router, weighted by the group's replicas, through Serve's
handles (async: no blocking Ray call). That is one hop more than a one-card model; a model on
one card keeps its one hop (``gpubroker.deployments.serve.http_model.HttpModel``).

Lost cards. Serve holds a request sent to a group whose replicas died on a lost node until the
group is redeployed (tens of seconds), so the router follows the broker's view of
the cards (``BrokerActor.card_health``, read every control interval by a task of its own, never
on a request's path). A *silent* card (its replicas missed five reports: the node may be gone,
the broker has not said so yet) gets no new request while another card of the model is not
silent; a *lost* one (its node left Ray, or 15 s of silence) gets none at all: the requests
still waiting there are ended with a 503 naming the card (Serve's request is cancelled), and
when every card of the model is lost the router answers 503 at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpubroker.broker.client import BrokerClient
from gpubroker.broker.wire import CardHealth
from gpubroker.deployments.serve.http_api import JSON_TYPE, HttpAnswer, answer_for
from gpubroker.deployments.serve.http_model import read_infer_request
from gpubroker.quotas.config import FleetConfig

BROKER_RPC_TIMEOUT_S = 10.0


def pick_group(in_flight: dict[str, int], replicas: dict[str, int], lost: frozenset[str] = frozenset()) -> str | None:
    """The card group with the fewest in-flight requests per replica (ties: the first card),
    of those not on a ``lost`` card; None when every group is."""
    order = list(in_flight)
    live = [cid for cid in order if cid not in lost]
    if not live:
        return None
    return min(live, key=lambda cid: (in_flight[cid] / max(1, replicas[cid]), order.index(cid)))


class CardRouter:
    """HTTP front of one model placed on several cards (Serve deployment, the app's ingress)."""

    def __init__(self, model: str, cfg: FleetConfig, groups: dict[str, Any], replicas: dict[str, int]):
        """``cfg``: the fleet config as the app builder parsed it (``gpubroker.deployments.app``);
        ``groups``: card id -> that card's deployment; ``replicas``: card id -> its replicas."""
        self.name = model
        self.spec = cfg.models[model]
        self.retry_after_s = max(1, int(round(cfg.broker.control_interval_s)))
        self.groups = groups  # card id -> DeploymentHandle of that card's group
        self.replicas = dict(replicas)
        self.in_flight = {cid: 0 for cid in groups}
        self.broker_name, self.broker_namespace = cfg.broker.name, cfg.broker.namespace
        self.poll_s = max(0.25, float(cfg.broker.control_interval_s))
        self.lost: frozenset[str] = frozenset()  # the broker's lost cards among this router's groups
        self.silent: frozenset[str] = frozenset()  # live, but their replicas stopped reporting
        self.waiting: dict[str, set[tuple[asyncio.Future, Any]]] = {cid: set() for cid in groups}
        self._broker: BrokerClient | None = None
        self._watch_task: asyncio.Task | None = None

    async def health_now(self) -> CardHealth:
        """The broker's ``card_health`` (one actor call; raises when the broker is away)."""
        if self._broker is None:
            import ray

            handle = await asyncio.to_thread(ray.get_actor, self.broker_name, namespace=self.broker_namespace)
            self._broker = BrokerClient(handle, BROKER_RPC_TIMEOUT_S)
        return await self._broker.card_health()

    async def _watch(self) -> None:
        while True:
            try:
                health = await self.health_now()
                self.set_health(health["lost"], health["silent"])
            except Exception:  # noqa: BLE001 - broker away or restarting: keep what it said last
                self._broker = None
            await asyncio.sleep(self.poll_s)

    def set_health(self, lost: Iterable[str], silent: Iterable[str] = ()) -> None:
        """Cards now lost: nothing more is sent there and what waits there is ended (503).
        Silent cards: no new request while a card of the model is not silent."""
        mine = frozenset(self.groups)
        now = frozenset(lost) & mine
        self.silent = (frozenset(silent) & mine) - now
        newly, self.lost = now - self.lost, now
        for cid in newly:
            for task, response in list(self.waiting[cid]):
                response.cancel()
                task.cancel()

    def _ensure_watch(self) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.get_running_loop().create_task(self._watch())

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
        self._ensure_watch()
        cid = pick_group(self.in_flight, self.replicas, self.lost | self.silent) if self.silent else None
        if cid is None:  # no silent card, or only silent ones left: they may be slow, not gone
            cid = pick_group(self.in_flight, self.replicas, self.lost)
        if cid is None:
            return self._unavailable(
                f"model '{self.name}' has no live card: {', '.join(sorted(self.lost))} lost; "
                "the broker re-places its replicas; retry later"
            )
        self.in_flight[cid] += 1
        response = self.groups[cid].infer.remote(parsed.inputs, len(body))
        call = (asyncio.ensure_future(response), response)
        self.waiting[cid].add(call)
        try:
            result = await call[0]
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if (current is not None and current.cancelling()) or cid not in self.lost:
                raise  # the client went away, not the card
            return self._unavailable(f"model '{self.name}': card {cid} was lost while the request ran; retry later")
        except Exception as exc:  # noqa: BLE001 - the group is gone (node lost): an explicit, retryable answer
            return self._unavailable(
                f"model '{self.name}' on card {cid} is unavailable ({type(exc).__name__}); retry later"
            )
        finally:
            self.in_flight[cid] -= 1
            self.waiting[cid].discard(call)
        return answer_for(self.name, result, parsed.single, self.retry_after_s)

    def _unavailable(self, detail: str) -> HttpAnswer:
        return HttpAnswer(503, {"detail": detail}, {"Retry-After": str(self.retry_after_s)})
