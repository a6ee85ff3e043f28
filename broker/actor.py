"""The broker as a named, detached Ray actor: a thin wrapper around ``gpubroker.broker.fleet_core.FleetBroker``.

``BrokerActor`` holds one ``FleetBroker`` on the wall clock, exports its metrics and ticks it every
``broker.control_interval_s``. Its methods are those of ``gpubroker.broker.wire.BrokerApi`` taking and
giving plain data: this is the actor's side of the one conversion (``to_dict``/``from_dict`` here; the
callers' side is ``gpubroker.broker.client.BrokerClient``); everything inside is typed. It calls nobody:
the Serve side pulls the ``ServePlan`` (``gpubroker.deployments.serve.follow``). ``start_broker`` and
``get_broker`` start and find it; the checkpoint lives in the Ray session directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from gpubroker.broker.client import BrokerClient, blocking
from gpubroker.broker.fleet_core import FleetBroker
from gpubroker.broker.metrics import start_exporter
from gpubroker.broker.wire import (
    ApplyResult,
    BrokerStatus,
    Calibration,
    CardCheckpoint,
    CardHealth,
    CardsChanged,
    DecisionRecord,
    Ping,
    PlacementFollowed,
    ReconcileView,
    RejectionsCounted,
    Replaced,
    StatsReport,
    TickResult,
)
from gpubroker.quotas.cards import Card
from gpubroker.quotas.config import FleetConfig, parse_config_text

logger = logging.getLogger("gpubroker.broker")


def default_checkpoint_path(cfg: FleetConfig) -> Path:
    """``broker.checkpoint_path``, else ``<ray session dir>/gpubroker/<name>.checkpoint.json``."""
    if cfg.broker.checkpoint_path:
        return Path(cfg.broker.checkpoint_path).expanduser()
    base: str | None = None
    try:
        import ray

        node = ray._private.worker._global_node  # noqa: SLF001 - the only way to the session dir
        if node is not None:
            base = node.get_session_dir_path()
    except Exception:  # noqa: BLE001
        base = None
    base = base or os.path.join(tempfile.gettempdir(), f"gpubroker-{os.getuid()}")
    return Path(base) / "gpubroker" / f"{cfg.broker.namespace}.{cfg.broker.name}.checkpoint.json"


def _detect_capacity(cfg: FleetConfig) -> int:
    if cfg.gpu.capacity_bytes is not None:
        return cfg.gpu.capacity_bytes
    from gpubroker.broker.capacity import detect_capacity

    return int(detect_capacity(cfg.gpu))


class BrokerActor:
    """Async Ray actor around ``FleetBroker`` (one ``BrokerCore`` per card) with the slow loop as a
    background task."""

    def __init__(
        self,
        config_text: str,
        capacity_bytes: int | None = None,
        checkpoint_path: str | None = None,
        cards: tuple[Card, ...] | None = None,
    ):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        cfg = parse_config_text(config_text, "broker config")
        path = checkpoint_path or str(default_checkpoint_path(cfg))
        capacity = capacity_bytes
        if capacity is None and cfg.gpus is None:
            capacity = _detect_capacity(cfg)
        self._core = FleetBroker(config_text, cards=cards, capacity_bytes=capacity, checkpoint_path=path)
        self._exporter = start_exporter(self._core.metrics, cfg.broker.metrics_host, cfg.broker.metrics_port)
        self._task: asyncio.Task[None] | None = None
        self._last_error: str | None = None
        self._started_s = time.time()
        # what the Serve side's follower last applied of the plan (gpubroker.deployments.serve.follow), for status
        self._reconcile = ReconcileView(applied_version=0, last=None, error=None, last_s=None, enabled=False)
        try:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        except RuntimeError:
            self._task = None  # started by the first call instead

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._core.config.broker.control_interval_s)
            try:
                self._core.tick()
                self._last_error = None
            except Exception as exc:  # noqa: BLE001 - keep the loop alive, surface the error in status
                self._last_error = repr(exc)
                logger.exception("broker tick failed")

    async def plan(self) -> dict[str, Any]:  # ServePlan
        """The ``ServePlan`` (``gpubroker.broker.wire``) the Serve side applies; it pulls it, the broker calls nobody."""
        self._ensure_loop()
        return self._core.plan().to_dict()

    async def follow_placement(self) -> PlacementFollowed:
        """A follower applies the plan to Serve (``gpubroker.deployments.serve.follow``): from now on a card loss or
        join re-places the fleet. Idempotent; a restarted broker gets it again from the follower."""
        self._ensure_loop()
        self._core.enable_replacement()
        return {"ok": True, "version": self._core.placement_version}

    async def observe_cards(self, alive: list[str]) -> CardsChanged:
        """The cards whose node is in the Ray cluster now, as the follower reads Ray."""
        return {"changed": self._core.observe_cards(alive)}

    async def plan_applied(self, version: int, result: Replaced | None, error: str | None) -> None:
        """What the follower applied of plan ``version`` (or why it failed): shown in status."""
        if error is None:
            self._reconcile["applied_version"], self._reconcile["last"] = version, result
            self._reconcile["error"], self._reconcile["last_s"] = None, time.time()
        else:
            self._reconcile["error"] = error

    async def ping(self) -> Ping:
        self._ensure_loop()
        return {
            "ok": True,
            "pid": os.getpid(),
            "started_s": self._started_s,
            "config_hash": self._core.status()["config_hash"],
        }

    async def register(
        self, model: str, replica_id: str, calibration: Calibration | None = None, card_id: str = ""
    ) -> dict[str, Any]:  # ModelSettings
        self._ensure_loop()
        return self._core.register(model, replica_id, calibration, card_id).to_dict()

    async def report(self, report: dict[str, Any]) -> dict[str, Any]:
        """A replica's ``StatsReport`` as plain data in, its ``ModelSettings`` as plain data out."""
        self._ensure_loop()
        return self._core.report(StatsReport.from_dict(report)).to_dict()

    async def report_rejections(self, counts: dict[str, int]) -> RejectionsCounted:
        self._ensure_loop()
        return self._core.report_rejections(counts)

    async def status(self) -> BrokerStatus:
        self._ensure_loop()
        out = self._core.status()
        out["pid"] = os.getpid()
        out["started_s"] = self._started_s
        out["last_error"] = self._last_error
        out["reconcile"] = ReconcileView(**{**self._reconcile, "enabled": self._core.replacing})
        out["metrics_url"] = self._exporter.url if self._exporter is not None else None
        return out

    async def decisions(self, model: str | None = None, since_seq: int = 0) -> list[DecisionRecord]:
        return self._core.decisions(model, since_seq)

    async def apply(self, config_text: str) -> ApplyResult:
        return self._core.apply(config_text)

    async def tick(self) -> TickResult:
        return self._core.tick()

    async def checkpoint_now(self) -> dict[str, CardCheckpoint]:
        return self._core.checkpoint_now()

    async def config_text(self) -> str:
        return self._core.config_text

    async def settings(self, model: str, card_id: str = "") -> dict[str, Any]:  # ModelSettings
        return self._core.settings(model, card_id).to_dict()

    async def card_health(self) -> CardHealth:
        """``lost``: cards marked lost; ``silent``: live cards whose replicas stopped reporting
        (``gpubroker.broker.fleet_core``). Card routers avoid both (``gpubroker.deployments.serve.http_cards``)."""
        return self._core.card_health()


RemoteBroker = ray.remote(BrokerActor)


HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's own resource on the head node (ray._common.constants)


def start_broker(
    config_text: str,
    *,
    capacity_bytes: int | None = None,
    checkpoint_path: str | None = None,
    cards: tuple[Card, ...] | None = None,
    timeout_s: float = 60.0,
) -> ray.actor.ActorHandle[BrokerActor]:
    """Create the named detached broker (or return the running one). Needs ray.init first.

    The broker is pinned to the head node (a worker node's loss must not take it down; a
    restart finds its checkpoint in the head's session directory). ``cards``: the discovered
    cards for ``gpus: auto`` (``gpubroker.deployments.cluster.discovery``)."""
    cfg = parse_config_text(config_text, "broker config")
    # The driver knows the session dir; a restarted actor gets the same path back.
    checkpoint_path = checkpoint_path or str(default_checkpoint_path(cfg))
    handle: Any = RemoteBroker.options(  # Any: Ray's stubs type an actor's methods without .remote
        name=cfg.broker.name,
        namespace=cfg.broker.namespace,
        lifetime="detached",
        max_restarts=-1,
        max_task_retries=-1,
        num_cpus=0,
        max_concurrency=64,
        get_if_exists=True,
        resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote(config_text, capacity_bytes, checkpoint_path, cards)
    blocking(BrokerClient(handle, timeout_s).ping())
    started: ray.actor.ActorHandle[BrokerActor] = handle
    return started


def get_broker(name: str = "gpubroker", namespace: str = "gpubroker") -> ray.actor.ActorHandle[BrokerActor]:
    """The running broker's handle (wrap it in a ``gpubroker.broker.client.BrokerClient`` to call it).
    Raises ValueError when there is none."""
    found: ray.actor.ActorHandle[BrokerActor] = ray.get_actor(name, namespace=namespace)
    return found
