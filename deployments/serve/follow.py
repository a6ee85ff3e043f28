"""The Serve side pulls the broker's plan and applies it: one return channel, one applier.

The broker publishes a ``gpubroker.broker.wire.ServePlan`` and calls nobody. ``PlanFollower`` runs in the
fleet API's replica (``gpubroker.deployments.serve.ingress.FleetApi``), every ``max(1 s, control_interval_s)``:

1. with a reconciler (a fleet of many cards deployed by ``gpubroker up``): tell the broker that a
   follower applies re-placements (``follow_placement``, idempotent: a restarted broker hears it
   again) and which cards' nodes are in the Ray cluster (``observe_cards``; a node that left
   loses its cards at once);
2. pull the plan; when its version moved, deploy the changed card groups
   (``gpubroker.deployments.serve.reconcile.ServeReconciler``, in a worker thread) and tell the broker what was
   applied (``plan_applied``, shown in its status);
3. apply the replica targets (``gpubroker.deployments.serve.scaler.ReplicaScaler``).

Blocking Ray calls run off the event loop; a broker that does not answer is retried next time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gpubroker.broker.client import BrokerClient
from gpubroker.broker.wire import Replaced, ServePlan
from gpubroker.deployments.serve.scaler import ERROR_LOG_EVERY_S, ReplicaScaler

logger = logging.getLogger("gpubroker.follow")

RPC_TIMEOUT_S = 10.0


class Reconciler(Protocol):
    """What the follower needs of ``gpubroker.deployments.serve.reconcile.ServeReconciler`` (named here, not
    imported: that module builds apps with ``gpubroker.deployments.app``, which holds the fleet API)."""

    def alive_cards(self) -> set[str]: ...

    def __call__(
        self, groups: Mapping[str, Mapping[str, int]], reasons: Mapping[str, str] | None = None
    ) -> Replaced: ...


class PlanFollower:
    """One ``step`` pulls the plan and applies it. ``get_broker``: looks up the broker actor's handle
    (or a stand-in with the same ``<method>.remote`` calls), called through a ``BrokerClient``."""

    def __init__(
        self, get_broker: Callable[[], Any], scaler: ReplicaScaler, reconciler: Reconciler | None = None
    ) -> None:
        self._get_broker = get_broker
        self._broker: BrokerClient | None = None
        self.scaler = scaler
        self.reconciler = reconciler
        self.applied_version = 0  # the deploy-time placement is what Serve runs at first
        self.last: Replaced | None = None  # what the latest re-placement applied

    async def _client(self) -> BrokerClient:
        if self._broker is None:
            self._broker = BrokerClient(await asyncio.to_thread(self._get_broker), RPC_TIMEOUT_S)
        return self._broker

    async def step(self) -> ServePlan:
        try:
            return await self._step(await self._client())
        except Exception:
            self._broker = None  # a restarted broker is looked up again
            raise

    async def _step(self, broker: BrokerClient) -> ServePlan:
        if self.reconciler is not None:
            await broker.follow_placement()  # first: the broker counts cards only while followed
            alive = await asyncio.to_thread(self.reconciler.alive_cards)
            await broker.observe_cards(sorted(alive))
        plan = await broker.plan()
        if self.reconciler is not None and plan.version != self.applied_version:
            await self._replace(broker, plan)
        await self.scaler.step(plan)
        return plan

    async def _replace(self, broker: BrokerClient, plan: ServePlan) -> None:
        assert self.reconciler is not None
        started = time.monotonic()
        try:
            done = await asyncio.to_thread(self.reconciler, plan.groups, plan.unplaced)
        except Exception as exc:
            await broker.plan_applied(plan.version, None, repr(exc))
            raise
        self.applied_version, self.last = plan.version, done
        logger.info("placement %d applied to Serve in %.2fs: %s", plan.version, time.monotonic() - started, done)
        await broker.plan_applied(plan.version, done, None)

    def view(self) -> dict[str, Any]:
        """JSON-safe: the scaler's calls and the re-placement applied last."""
        return {**self.scaler.view(), "placement_version": self.applied_version, "replaced": self.last}


async def follow_loop(follower: PlanFollower, interval_s: float) -> None:
    """Forever: every ``interval_s`` one ``step``; a failure is logged (at most once a minute) and
    retried at the next step; the loop ends only when cancelled."""
    last_log = float("-inf")
    while True:
        await asyncio.sleep(interval_s)
        try:
            await follower.step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - keep following once the broker answers again
            if time.monotonic() - last_log >= ERROR_LOG_EVERY_S:
                last_log = time.monotonic()
                logger.warning("follow: plan not applied (%r); retrying", exc)
