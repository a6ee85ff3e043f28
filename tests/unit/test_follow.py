"""One return channel: the Serve side pulls the broker's ``ServePlan`` and applies it (``gpubroker.deployments.serve.follow``).

A real ``BrokerActor`` built in this process (no Ray: its methods called as a handle would, plain
data both ways), the four-card fleet of ``tests/unit/test_fleet_replace.py``, a fake reconciler
(which cards are alive, what it was asked to deploy) and a fake Serve scaler. Node-b leaves the
Ray cluster: the follower tells the broker, the broker re-places, the follower deploys the new
card groups and scales the live cards' deployments; the actor holds nothing of ``deployments``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from gpubroker.broker.actor import BrokerActor
from gpubroker.broker.wire import ServePlan
from gpubroker.deployments.serve.follow import PlanFollower
from gpubroker.deployments.serve.scaler import ReplicaScaler
from tests.unit.test_fleet_replace import CONFIG

APPS = {"spread": "t-spread", "solo": "t-solo", "west": "t-west"}


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)  # the actor's coroutine, as a Ray handle's call is awaited


class Handle:
    """``handle.<method>.remote(...)`` in front of an in-process actor."""

    def __init__(self, actor: BrokerActor) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.actor, name))


class FakeReconciler:
    def __init__(self) -> None:
        self.alive = {"a0", "a1", "b0", "b1"}
        self.deployed: list[dict[str, dict[str, int]]] = []

    def alive_cards(self) -> set[str]:
        return set(self.alive)

    def __call__(self, groups: Mapping[str, Mapping[str, int]], reasons: Mapping[str, str] | None = None) -> dict:
        self.deployed.append({m: dict(g) for m, g in groups.items()})
        return {"redeployed": sorted(m for m, g in groups.items() if "b0" not in g), "unplaced": sorted(reasons or {})}


class Refusing(FakeReconciler):
    def __init__(self, alive: set[str]) -> None:
        super().__init__()
        self.alive = alive

    def __call__(self, groups: Mapping[str, Mapping[str, int]], reasons: Mapping[str, str] | None = None) -> dict:
        raise RuntimeError("serve controller unreachable")


def test_a_card_loss_reaches_serve_through_the_plan_the_follower_pulls(tmp_path):
    async def body() -> None:
        actor = BrokerActor(CONFIG, checkpoint_path=str(tmp_path / "b.checkpoint.json"))
        assert not any(type(v).__module__.startswith("deployments") for v in vars(actor).values())
        calls: list[tuple[str, str, int]] = []

        async def set_replicas(app: str, dep: str, n: int) -> None:
            calls.append((app, dep, n))

        rec = FakeReconciler()
        follower = PlanFollower(lambda: Handle(actor), ReplicaScaler(APPS, set_replicas), rec)

        first = await follower.step()  # every card alive: the deploy-time placement, re-placement turned on
        assert first.version == 0 and rec.deployed == [] and follower.applied_version == 0
        assert ServePlan.from_dict(await actor.plan()).replacing
        assert ("t-spread", "spread@b0", 1) in calls and ("t-west", "west", 1) in calls

        rec.alive = {"a0", "a1"}  # node-b left the Ray cluster
        calls.clear()
        plan = await follower.step()
        assert plan.version == 1 and follower.applied_version == 1
        assert rec.deployed == [{"spread": {"a0": 1, "a1": 1}, "solo": {"a0": 1}, "west": {}}]
        assert set(plan.unplaced) == {"west"} and "no live card" in plan.unplaced["west"]
        assert {t.card_id for t in plan.replica_targets} == {"a0", "a1"}  # the lost cards are not scaled
        status = await actor.status()
        assert status["reconcile"]["applied_version"] == 1 and status["reconcile"]["error"] is None
        assert status["reconcile"]["enabled"] and status["reconcile"]["last"]["unplaced"] == ["west"]

        await follower.step()  # nothing moved: nothing deployed again
        assert len(rec.deployed) == 1

    asyncio.run(body())


def test_a_failed_deploy_is_shown_and_tried_again(tmp_path):
    async def body() -> None:
        actor = BrokerActor(CONFIG, checkpoint_path=str(tmp_path / "b.checkpoint.json"))

        async def set_replicas(app: str, dep: str, n: int) -> None:
            return None

        rec = FakeReconciler()
        follower = PlanFollower(lambda: Handle(actor), ReplicaScaler(APPS, set_replicas), rec)
        await follower.step()
        rec.alive = {"a0", "a1"}
        follower.reconciler = Refusing(rec.alive)
        try:
            await follower.step()
        except RuntimeError:
            pass
        else:
            raise AssertionError("the failure must reach the loop (it logs and retries)")
        status = await actor.status()
        assert "unreachable" in status["reconcile"]["error"] and follower.applied_version == 0
        follower.reconciler = rec
        await follower.step()
        assert follower.applied_version == 1 and (await actor.status())["reconcile"]["error"] is None

    asyncio.run(body())
