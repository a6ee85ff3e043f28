"""Replica targets to Serve: the plan's ``replica_targets`` become each deployment's replica count.

The broker decides (``gpubroker.broker.control.replica_rules``) and publishes the targets in its
``ServePlan``; it never calls Serve. ``ReplicaScaler`` is the thin applier, run by the fleet
API's plan follower (``gpubroker.deployments.serve.follow``): it applies the targets that changed and every
``RESYNC_S`` all of them again (a redeploy of an app sets its configured count back). In dry run
nothing is applied.

How Serve is updated (Ray Serve 2.60): re-running ``serve.run`` with another ``num_replicas``
would roll every replica (a new code version), so the model apps are deployed with
``external_scaler_enabled=True`` and the scaler calls
``ServeController.update_deployment_replicas(DeploymentID, n)``, which sets the target count
only: the replicas that stay keep running.

Known limits: a model on several cards keeps its ``CardRouter``'s replica weights as deployed;
each replica keeps its share of the grant as deployed (``grant / deployed replicas``), so fewer
replicas hold less of the grant and the lending rules see the rest as unused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpubroker.broker.wire import ServePlan
from gpubroker.deployments.serve.placement_resources import deployment_name

logger = logging.getLogger("gpubroker.scaler")

RESYNC_S = 60.0  # re-apply every target this often, though it did not change
ERROR_LOG_EVERY_S = 60.0  # a failing call is logged at most this often per deployment

SetReplicas = Callable[[str, str, int], Awaitable[None]]  # (app, deployment, replicas)


def deployment_targets(plan: ServePlan, app_names: Mapping[str, str]) -> dict[tuple[str, str], int]:
    """``{(Serve app, deployment): replicas}`` from the broker's plan: one entry per model on each
    live card (``<model>``, or ``<model>@<card>`` for a model on several cards). ``app_names``:
    model -> its Serve application (the models without one, LLM engines, are not scaled)."""
    out: dict[tuple[str, str], int] = {}
    for t in plan.replica_targets:
        app = app_names.get(t.model)
        if app is None:
            continue
        cards_of_model = len(plan.groups.get(t.model) or {t.card_id: 1})
        out[(app, deployment_name(t.model, t.card_id, cards_of_model))] = t.replicas
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

    async def step(self, plan: ServePlan) -> list[ScaleCall]:
        if plan.dry_run:
            return []
        now = self._clock()
        resync = self._synced_s is None or now - self._synced_s >= self._resync_s
        if resync:
            self._synced_s = now
        done: list[ScaleCall] = []
        for key, n in sorted(deployment_targets(plan, self.app_names).items()):
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


__all__ = ["RESYNC_S", "ReplicaScaler", "ScaleCall", "ServeReplicaSetter", "deployment_targets"]
