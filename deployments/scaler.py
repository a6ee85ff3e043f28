"""Replica targets to Serve: the broker's ``replica_target`` becomes each deployment's replica count.

The broker decides (``broker.control.replica_rules``: fewer replicas under a ``throughput`` profile when
larger batches carry the load, the configured count otherwise) and shows the targets in
``status`` per card (``cards[].models.<m>.replica_target``); it never calls Serve. This module
is the thin applier, in the deploying layer.

How Serve is updated (Ray Serve 2.60). Re-running ``serve.run`` with another ``num_replicas``
would roll every replica of the app: ``serve.run`` gives each deployment a random code version
unless one is set (``ray/serve/_private/client.py``, ``deploy_applications``), and a new version
restarts replicas. Serve 2.60 has an external-scaler API instead: an application deployed with
``external_scaler_enabled=True`` (``RunTarget``, or ``external_scaler_enabled: true`` in a Serve
config file) accepts ``ServeController.update_deployment_replicas(DeploymentID, n)``, the call
behind the dashboard's ``POST /api/v1/applications/{app}/deployments/{name}/scale``. It sets the
target count only (``DeploymentState.set_target_num_replicas``: same info, same version), so the
replicas that stay keep running; Serve starts the missing ones or stops the extra ones (after
their graceful shutdown). ``deployments.app.run_fleet`` and ``serve_config`` enable it on every
model app (Serve refuses it with ``autoscaling_config``, which no model app uses).

Where it runs: in the fleet API's replica (``deployments.ingress.FleetApi``), a background task
every ``max(1 s, broker.control_interval_s)``: read the broker's status, apply the targets that
changed, and every ``RESYNC_S`` all of them again (a redeploy of an app sets its configured count
back; the controller ignores a count it already has). That replica exists in both ways a fleet
is deployed (``gpubroker up`` and ``serve deploy``), already talks to the broker, and Serve
restarts it if it dies; the broker stays free of Serve. In dry run nothing is applied.

Known limits: a model on several cards keeps its ``CardRouter``'s replica weights as deployed
(its least-in-flight choice corrects for a card with fewer replicas); each replica keeps its share
of the grant as deployed (``grant / deployed replicas``), so fewer replicas hold less of the grant
and the lending rules see the rest as unused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from deployments.placement_resources import deployment_name

logger = logging.getLogger("gpubroker.scaler")

RESYNC_S = 60.0  # re-apply every target this often, though it did not change
ERROR_LOG_EVERY_S = 60.0  # a failing call is logged at most this often per deployment

SetReplicas = Callable[[str, str, int], Awaitable[None]]  # (app, deployment, replicas)


def deployment_targets(status: Mapping[str, Any], app_names: Mapping[str, str]) -> dict[tuple[str, str], int]:
    """``{(Serve app, deployment): replicas}`` from the broker's status: one entry per model on each
    live card (``<model>``, or ``<model>@<card>`` for a model on several cards). ``app_names``:
    model -> its Serve application (the models without one, LLM engines, are not scaled)."""
    models = status.get("models") or {}
    out: dict[tuple[str, str], int] = {}
    for card in status.get("cards") or []:
        if not card.get("live", True):
            continue
        for name, m in (card.get("models") or {}).items():
            app, target = app_names.get(name), m.get("replica_target")
            if app is None or target is None:
                continue
            cards_of_model = len((models.get(name) or {}).get("cards") or [card["id"]])
            out[(app, deployment_name(name, card["id"], cards_of_model))] = int(target)
    return out


@dataclass(frozen=True)
class ScaleCall:
    """One call to Serve: a deployment's replica count, and whether Serve took it."""

    app: str
    deployment: str
    replicas: int
    ok: bool
    error: str | None = None


class ReplicaScaler:
    """Applies the broker's replica targets through ``set_replicas`` (Serve's controller in
    production, a fake in tests). ``step`` is one pass; it never raises for one deployment's failure."""

    def __init__(
        self,
        app_names: Mapping[str, str],
        set_replicas: SetReplicas,
        *,
        clock: Callable[[], float] = time.monotonic,
        resync_s: float = RESYNC_S,
    ) -> None:
        self.app_names = dict(app_names)
        self._set = set_replicas
        self._clock = clock
        self._resync_s = resync_s
        self._synced_s: float | None = None
        self.applied: dict[tuple[str, str], int] = {}  # what Serve last accepted
        self.errors: dict[tuple[str, str], str] = {}
        self._logged_s: dict[tuple[str, str], float] = {}
        self.calls = 0

    async def step(self, status: Mapping[str, Any]) -> list[ScaleCall]:
        if status.get("dry_run"):
            return []
        now = self._clock()
        resync = self._synced_s is None or now - self._synced_s >= self._resync_s
        if resync:
            self._synced_s = now
        done: list[ScaleCall] = []
        for key, n in sorted(deployment_targets(status, self.app_names).items()):
            if not resync and self.applied.get(key) == n:
                continue
            app, dep = key
            self.calls += 1
            try:
                await self._set(app, dep, n)
            except Exception as exc:  # noqa: BLE001 - one deployment's failure must not stop the others
                self.errors[key] = f"{type(exc).__name__}: {exc}"
                if now - self._logged_s.get(key, float("-inf")) >= ERROR_LOG_EVERY_S:
                    self._logged_s[key] = now
                    logger.warning("scaler: %s/%s -> %d replicas failed: %s", app, dep, n, self.errors[key])
                done.append(ScaleCall(app, dep, n, False, self.errors[key]))
                continue
            if self.applied.get(key) != n:
                logger.info("scaler: %s/%s -> %d replicas", app, dep, n)
            self.applied[key] = n
            self.errors.pop(key, None)
            done.append(ScaleCall(app, dep, n, True))
        return done

    def view(self) -> dict[str, Any]:
        """JSON-safe: what was applied and what failed, by ``app/deployment``."""
        return {
            "applied": {f"{a}/{d}": n for (a, d), n in sorted(self.applied.items())},
            "errors": {f"{a}/{d}": e for (a, d), e in sorted(self.errors.items())},
            "calls": self.calls,
        }


class ServeReplicaSetter:
    """``set_replicas`` on Ray Serve: ``ServeController.update_deployment_replicas`` (the external
    scaler API; the app must be deployed with ``external_scaler_enabled``). Async: the controller
    is looked up off the event loop once and the call is awaited."""

    def __init__(self) -> None:
        self._controller: Any = None

    async def __call__(self, app: str, deployment: str, replicas: int) -> None:
        from ray.serve._private.common import DeploymentID

        if self._controller is None:
            self._controller = await asyncio.to_thread(_serve_controller)
        try:
            await self._controller.update_deployment_replicas.remote(
                DeploymentID(name=deployment, app_name=app), replicas
            )
        except Exception:
            self._controller = None  # a restarted controller is looked up again
            raise


def _serve_controller() -> Any:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


async def scaler_loop(
    read_status: Callable[[], Awaitable[Mapping[str, Any]]], scaler: ReplicaScaler, interval_s: float
) -> None:
    """Forever: every ``interval_s``, the broker's status in, its targets to Serve. A broker that
    does not answer is skipped (logged once a minute); the loop never ends on an error."""
    last_log = float("-inf")
    while True:
        await asyncio.sleep(interval_s)
        try:
            await scaler.step(await read_status())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - keep scaling once the broker answers again
            if time.monotonic() - last_log >= ERROR_LOG_EVERY_S:
                last_log = time.monotonic()
                logger.warning("scaler: no broker status (%r); retrying", exc)


__all__ = ["RESYNC_S", "ReplicaScaler", "ScaleCall", "ServeReplicaSetter", "deployment_targets", "scaler_loop"]
