"""The callers' side of the Ray boundary: ``BrokerClient`` offers ``gpubroker.broker.wire.BrokerApi``
over the broker actor's handle.

Every caller of the broker (a replica's ``gpubroker.deployments.replica.broker_link``, the plan follower
``gpubroker.deployments.serve.follow``, the fleet API ``gpubroker.deployments.serve.ingress``, the CLI's
``gpubroker.deployments.cluster.fleet_client``) holds one, so the wire types are converted to plain data
and back here and only here (the actor, ``gpubroker.broker.actor``, is the other side). Each call
waits at most ``timeout_s``; a caller with no event loop runs one with ``blocking``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from gpubroker.broker.wire import (
    ApplyResult,
    BrokerApi,
    BrokerStatus,
    Calibration,
    CardCheckpoint,
    CardHealth,
    CardsChanged,
    DecisionRecord,
    ModelSettings,
    Ping,
    PlacementFollowed,
    RejectionsCounted,
    Replaced,
    ServePlan,
    StatsReport,
    TickResult,
)

T = TypeVar("T")


class RemoteMethod(Protocol):
    """``handle.<method>``: ``remote(...)`` gives something to await (a Ray ``ObjectRef``, or a
    coroutine in a test's stand-in)."""

    def remote(self, *args: Any) -> Awaitable[Any]: ...


class ActorHandle(Protocol):
    """The broker actor's handle (``ray.get_actor``) as this client uses it: plain data both ways."""

    def __getattr__(self, name: str) -> RemoteMethod: ...


class BrokerClient:
    """``BrokerApi`` over an actor handle: wire types in and out, plain data over Ray."""

    def __init__(self, handle: Any, timeout_s: float) -> None:
        self.handle: ActorHandle = handle  # Ray's ActorHandle, or a stand-in with the same calls
        self.timeout_s = timeout_s

    async def _call(self, method: str, *args: Any) -> Any:
        return await asyncio.wait_for(getattr(self.handle, method).remote(*args), timeout=self.timeout_s)

    async def ping(self) -> Ping:
        out: Ping = await self._call("ping")
        return out

    async def register(
        self, model: str, replica_id: str, calibration: Calibration | None = None, card_id: str = ""
    ) -> ModelSettings:
        # one-card fleets' stand-ins (a BrokerCore in tests and benches) take no card id
        args = (model, replica_id, calibration, card_id) if card_id else (model, replica_id, calibration)
        return ModelSettings.from_dict(await self._call("register", *args))

    async def report(self, report: StatsReport) -> ModelSettings:
        return ModelSettings.from_dict(await self._call("report", report.to_dict()))

    async def report_rejections(self, counts: Mapping[str, int]) -> RejectionsCounted:
        out: RejectionsCounted = await self._call("report_rejections", dict(counts))
        return out

    async def plan(self) -> ServePlan:
        return ServePlan.from_dict(await self._call("plan"))

    async def follow_placement(self) -> PlacementFollowed:
        out: PlacementFollowed = await self._call("follow_placement")
        return out

    async def observe_cards(self, alive: list[str]) -> CardsChanged:
        out: CardsChanged = await self._call("observe_cards", list(alive))
        return out

    async def plan_applied(self, version: int, result: Replaced | None, error: str | None) -> None:
        await self._call("plan_applied", version, result, error)

    async def card_health(self) -> CardHealth:
        out: CardHealth = await self._call("card_health")
        return out

    async def status(self) -> BrokerStatus:
        out: BrokerStatus = await self._call("status")
        return out

    async def decisions(self, model: str | None = None, since_seq: int = 0) -> list[DecisionRecord]:
        out: list[DecisionRecord] = await self._call("decisions", model, since_seq)
        return out

    async def apply(self, config_text: str) -> ApplyResult:
        out: ApplyResult = await self._call("apply", config_text)
        return out

    async def tick(self) -> TickResult:
        out: TickResult = await self._call("tick")
        return out

    async def checkpoint_now(self) -> dict[str, CardCheckpoint]:
        out: dict[str, CardCheckpoint] = await self._call("checkpoint_now")
        return out

    async def config_text(self) -> str:
        return str(await self._call("config_text"))

    async def settings(self, model: str, card_id: str = "") -> ModelSettings:
        return ModelSettings.from_dict(await self._call("settings", model, card_id))


def blocking(call: Coroutine[Any, Any, T]) -> T:
    """One client call from synchronous code (the CLI, ``gpubroker up``), run to its end on an event
    loop of its own (in a worker thread when this thread runs one already)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(call)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, call).result()


def _offers(client: BrokerClient) -> BrokerApi:  # the type checker holds the client to the protocol
    return client
