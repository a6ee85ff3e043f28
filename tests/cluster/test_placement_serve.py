"""configs/cluster-demo.yaml is placed as planned: every Serve replica runs on the node holding its card."""

from __future__ import annotations

import os

import pytest

from tests.cluster.harness import CardCluster, wait_until

pytestmark = pytest.mark.integration


class WhereAmI:
    """Stands in for a model replica (same constructor args): says which node and card it runs on."""

    def __init__(self, model: str, cfg: object, card_id: str = "", replicas_on_card: int = 1) -> None:
        self.model = model
        self.card_id = card_id  # what bind_model_groups tells the replica (ModelReplica's signature)

    def __call__(self) -> dict:
        import ray

        return {
            "model": self.model,
            "node_id": ray.get_runtime_context().get_node_id(),
            "card": os.environ.get("GPUBROKER_CARD_ID"),
            "card_arg": self.card_id,
        }


class Root:
    def __init__(self, groups: dict) -> None:
        self.groups = groups

    def __call__(self) -> str:
        return "ok"


@pytest.fixture(scope="module")
def placed():
    from ray import serve

    from gpubroker.deployments.serve.placement_resources import bind_model_groups, deployment_plans
    from gpubroker.quotas.config import load_config
    from gpubroker.quotas.placement import place_fleet

    cfg = load_config("configs/cluster-demo.yaml")
    cc = CardCluster(cfg)
    try:
        placement = place_fleet(cfg)
        groups = bind_model_groups(cfg, placement, model_num_cpus=0.05, deployment_cls=WhereAmI)
        serve.start(proxy_location="Disabled")
        serve.run(
            serve.deployment(Root).options(ray_actor_options={"num_cpus": 0}).bind(groups),
            name="placed",
            route_prefix=None,
        )
        yield cc, placement, deployment_plans(placement, model_num_cpus=0.05)
    finally:
        cc.shutdown()


def test_every_replica_runs_on_the_node_of_its_card(placed):
    from ray import serve

    cc, placement, plans = placed
    assert {p.card_id for p in plans} == {"a0", "a1", "b0", "b1"}  # the demo uses every card
    for plan in plans:
        handle = serve.get_deployment_handle(plan.name, app_name="placed")
        seen = [handle.remote().result(timeout_s=60) for _ in range(2 * plan.num_replicas)]
        for answer in seen:
            assert answer["model"] == plan.model and answer["card"] == answer["card_arg"] == plan.card_id, (
                plan,
                answer,
            )
            assert answer["node_id"] == cc.node_of_card(plan.card_id), (plan, answer)
    assert cc.node_of_card("a0") == cc.node_id("node-a") and cc.node_of_card("b1") == cc.node_id("node-b")


def test_a_cards_resource_admits_no_more_replicas_than_were_placed(placed):
    import ray

    cc, placement, plans = placed
    # every card's resource is fully taken by its placed replicas (1000 // processes each)
    avail = wait_until(lambda: ray.available_resources(), what="available resources")
    for card in placement.cards:
        left = avail.get(f"gpubroker_card_{card.card.id}", 0.0)
        assert left < 1000 // card.processes, (card.card.id, left)


@pytest.mark.slow  # about 90 s: node death detection, then the replicas' restart on the new node
def test_a_lost_node_s_replicas_come_back_when_its_cards_rejoin(placed):
    """Node loss then join: the replicas of node-b's cards cannot run anywhere else (their card
    resources went with the node, so nothing over-commits node-a's cards); once a node with
    those cards joins, Serve starts them there. Last in the module: it replaces node-b."""
    from ray import serve

    cc, placement, plans = placed
    old_b = cc.node_id("node-b")
    cc.kill_node("node-b")
    wait_until(lambda: set(cc.card_nodes()) == {"a0", "a1"}, timeout_s=90, what="node-b's cards gone from the cluster")
    on_a = [p for p in plans if p.card_id in ("a0", "a1")]
    for plan in on_a:  # node-a's replicas keep answering from node-a
        handle = serve.get_deployment_handle(plan.name, app_name="placed")
        assert handle.remote().result(timeout_s=60)["node_id"] == cc.node_id("node-a")
    cc.add_node("node-b")
    new_b = cc.node_id("node-b")
    assert new_b != old_b and cc.node_of_card("b0") == new_b
    for plan in (p for p in plans if p.card_id in ("b0", "b1")):
        handle = serve.get_deployment_handle(plan.name, app_name="placed")

        def answered_from_new_node(h=handle):
            try:
                return h.remote().result(timeout_s=10)["node_id"] == new_b
            except Exception:  # noqa: BLE001 - the replica is still restarting
                return False

        wait_until(answered_from_new_node, timeout_s=180, every_s=2, what=f"{plan.name} back on the new node-b")
