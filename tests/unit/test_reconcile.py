"""What ``gpubroker.deployments.serve.reconcile.ServeReconciler`` would deploy after a re-placement (no Ray running).

Uses the fleet of ``tests/unit/test_fleet_replace.py``: after node-b's loss spread keeps its
a0 group exactly as deployed (so Serve leaves it running) and gets a new a1 group pinned to
node-a by label without a card resource; west has no replica placed and gets the stand-in
ingress; solo's app is not touched. Also: the reconciler pickles (the fleet API's replica gets it),
and the proxy location for nodes sharing one address.
"""

from __future__ import annotations

import pickle

from gpubroker.broker.fleet_core import FleetBroker
from gpubroker.deployments.app import deployment_version
from gpubroker.deployments.cluster.fleet import proxy_location
from gpubroker.deployments.serve.placement_resources import NODE_LABEL, card_resource
from gpubroker.deployments.serve.reconcile import ServeReconciler, moved_actor_options
from gpubroker.quotas.config import parse_config_text
from tests.unit.test_fleet_replace import CONFIG


def _after_loss():
    fb = FleetBroker(CONFIG)
    fb.enable_replacement()
    fb.observe_cards({"a0", "a1", "b0", "b1"})
    fb.observe_cards({"a0", "a1"})
    return fb


def test_a_kept_group_is_as_deployed_and_a_moved_one_is_pinned_by_node_label():
    fb = _after_loss()
    rec = ServeReconciler(parse_config_text(CONFIG), CONFIG, model_num_cpus=0.05)
    plans, router = rec.plans_for("spread", fb.plan().groups)
    assert router and [p.name for p in plans] == ["spread@a0", "spread@a1"]
    kept, moved = plans
    assert kept.ray_actor_options["resources"] == {card_resource("a0"): 500.0}  # as deployed: 2 processes on a0
    assert "resources" not in moved.ray_actor_options
    assert moved.ray_actor_options["label_selector"] == {NODE_LABEL: "node-a"}
    assert moved.ray_actor_options["runtime_env"]["env_vars"]["GPUBROKER_CARD_ID"] == "a1"
    assert moved.ray_actor_options == moved_actor_options(fb.placement.card("a1"), 0.05)


def test_only_changed_models_are_redeployed_and_an_unplaced_one_gets_the_stand_in():
    fb = _after_loss()
    rec = pickle.loads(
        pickle.dumps(ServeReconciler(parse_config_text(CONFIG), CONFIG, fleet_app="t", model_num_cpus=0.05))
    )
    plan = fb.plan()
    apps, result = rec.apps_for(plan.groups, plan.unplaced)
    assert [a.name for a in apps] == ["t-spread", "t-west"]  # solo did not move
    assert result.unplaced == ("west",) and result.kept == {"spread": ["spread@a0"], "west": []}
    assert result.groups == {"spread": {"a0": 1, "a1": 1}, "west": {}}
    assert [a.route_prefix for a in apps] == ["/v1/models/spread", "/v1/models/west"]


def test_versions_follow_what_a_deployment_runs():
    a = deployment_version(dict, "m@a0", 1, {"num_cpus": 0.1}, ("m", "cfg", "a0", 1))
    assert a == deployment_version(dict, "m@a0", 1, {"num_cpus": 0.1}, ("m", "cfg", "a0", 1))
    assert a != deployment_version(dict, "m@a0", 2, {"num_cpus": 0.1}, ("m", "cfg", "a0", 2))
    assert a != deployment_version(dict, "m@a0", 1, {"num_cpus": 0.1}, ("m", "other cfg", "a0", 1))


def test_two_nodes_on_one_address_get_a_head_only_proxy():
    one_machine = [{"NodeManagerAddress": "10.0.0.1"}, {"NodeManagerAddress": "10.0.0.1"}]
    two = [{"NodeManagerAddress": "10.0.0.1"}, {"NodeManagerAddress": "10.0.0.2"}]
    assert proxy_location(one_machine) == "HeadOnly"
    assert proxy_location(two) == "EveryNode"
    assert proxy_location([*two, {"NodeManagerAddress": "10.0.0.2", "Alive": False}]) == "EveryNode"
