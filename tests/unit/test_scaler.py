"""The replica scaler (``gpubroker.deployments.serve.scaler``): the broker's plan -> Serve deployments' replica counts.

No Ray: a fake ``set_replicas`` records the calls and a fake clock drives the resync.
"""

from __future__ import annotations

import asyncio

from gpubroker.broker.fleet_core import FleetBroker
from gpubroker.broker.wire import ReplicaTarget, ServePlan
from gpubroker.deployments.serve.scaler import ReplicaScaler, ScaleCall, deployment_targets
from tests.unit.test_fleet_core import CONFIG as CARDS_CONFIG

APPS = {"hot": "gpubroker-hot", "cold": "gpubroker-cold"}


def status(targets: dict[str, dict[str, int]], *, lost: tuple[str, ...] = (), dry_run: bool = False) -> ServePlan:
    """A broker plan with ``targets``: card -> model -> replica target (none on a lost card)."""
    groups: dict[str, dict[str, int]] = {}
    for cid, models in targets.items():
        for m in models:
            groups.setdefault(m, {})[cid] = 1
    return ServePlan(
        version=0,
        groups=groups,
        unplaced={},
        replica_targets=tuple(
            ReplicaTarget(m, cid, n) for cid, models in targets.items() if cid not in lost for m, n in models.items()
        ),
        replacing=False,
        dry_run=dry_run,
    )


class Calls:
    def __init__(self, fail: set[str] = frozenset()):
        self.calls: list[tuple[str, str, int]] = []
        self.fail = fail

    async def __call__(self, app: str, dep: str, n: int) -> None:
        self.calls.append((app, dep, n))
        if dep in self.fail:
            raise RuntimeError(f"{dep} refused")


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_targets_name_the_deployments_as_deployed():
    one_card = status({"card0": {"hot": 2, "cold": 1}})
    assert deployment_targets(one_card, APPS) == {("gpubroker-hot", "hot"): 2, ("gpubroker-cold", "cold"): 1}
    # a model on two cards is one deployment per card, <model>@<card>; a lost card is not scaled
    many = status({"a0": {"hot": 1, "cold": 2}, "b0": {"hot": 3}}, lost=("a0",))
    assert deployment_targets(many, APPS) == {("gpubroker-hot", "hot@b0"): 3}
    many = status({"a0": {"hot": 1, "cold": 2}, "b0": {"hot": 3}})
    assert deployment_targets(many, APPS) == {
        ("gpubroker-hot", "hot@a0"): 1,
        ("gpubroker-hot", "hot@b0"): 3,
        ("gpubroker-cold", "cold"): 2,
    }
    # a model without a Serve app of its own (an LLM engine) is left alone
    assert deployment_targets(status({"card0": {"llm": 1}}), APPS) == {}


def test_the_fleet_brokers_plan_maps_to_every_deployment():
    fb = FleetBroker(CARDS_CONFIG, clock=lambda: 1_000_000.0)
    fb.tick()
    got = deployment_targets(ServePlan.from_dict(fb.plan().to_dict()), APPS)  # as it crosses Ray
    assert got == {
        ("gpubroker-hot", "hot@a0"): 1,
        ("gpubroker-hot", "hot@b0"): 1,
        ("gpubroker-cold", "cold@a0"): 1,
        ("gpubroker-cold", "cold@b0"): 1,
    }


def test_only_changes_are_applied_until_the_resync():
    calls, clock = Calls(), Clock()
    sc = ReplicaScaler(APPS, calls, clock=clock, resync_s=60.0)
    first = asyncio.run(sc.step(status({"card0": {"hot": 3, "cold": 1}})))
    assert [c.replicas for c in first] == [1, 3] and all(c.ok for c in first)  # the first pass applies all
    clock.t = 1.0
    assert asyncio.run(sc.step(status({"card0": {"hot": 3, "cold": 1}}))) == []
    clock.t = 2.0
    done = asyncio.run(sc.step(status({"card0": {"hot": 1, "cold": 1}})))
    assert done == [ScaleCall("gpubroker-hot", "hot", 1, True)]
    assert sc.view()["applied"] == {"gpubroker-cold/cold": 1, "gpubroker-hot/hot": 1}
    clock.t = 62.5  # a redeploy may have set the configured count back: every target again
    assert len(asyncio.run(sc.step(status({"card0": {"hot": 1, "cold": 1}})))) == 2
    assert calls.calls[-2:] == [("gpubroker-cold", "cold", 1), ("gpubroker-hot", "hot", 1)]


def test_a_failed_call_is_kept_and_retried_and_does_not_stop_the_others():
    calls, clock = Calls(fail={"hot"}), Clock()
    sc = ReplicaScaler(APPS, calls, clock=clock)
    done = asyncio.run(sc.step(status({"card0": {"hot": 2, "cold": 1}})))
    assert [(c.deployment, c.ok) for c in done] == [("cold", True), ("hot", False)]
    assert "hot refused" in sc.view()["errors"]["gpubroker-hot/hot"]
    calls.fail = set()
    clock.t = 1.0
    done = asyncio.run(sc.step(status({"card0": {"hot": 2, "cold": 1}})))
    assert done == [ScaleCall("gpubroker-hot", "hot", 2, True)] and sc.view()["errors"] == {}


def test_dry_run_applies_nothing():
    calls = Calls()
    sc = ReplicaScaler(APPS, calls, clock=Clock())
    assert asyncio.run(sc.step(status({"card0": {"hot": 1}}, dry_run=True))) == [] and calls.calls == []
