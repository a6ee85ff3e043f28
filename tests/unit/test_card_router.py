"""A model placed on several cards: its app is a router over one deployment per card (no Ray)."""

from __future__ import annotations

from deployments.http_cards import pick_group
from quotas.config import load_config
from quotas.placement import place_fleet


def test_the_router_sends_to_the_least_loaded_group_per_replica():
    assert pick_group({"a0": 0, "b0": 0}, {"a0": 1, "b0": 1}) == "a0"  # ties: the first card
    assert pick_group({"a0": 3, "b0": 1}, {"a0": 1, "b0": 1}) == "b0"
    assert pick_group({"a0": 3, "b0": 2}, {"a0": 4, "b0": 1}) == "a0"  # 0.75 per replica against 2


def test_cluster_demo_apps_follow_the_placement():
    from deployments.app import fleet_apps
    from deployments.placement_resources import card_resource

    cfg = load_config("configs/cluster-demo.yaml")
    text = open("configs/cluster-demo.yaml", encoding="utf-8").read()
    placement = place_fleet(cfg)
    apps = {a.name: a.app for a in fleet_apps(cfg, text)}
    for model in cfg.models:
        app = apps[f"gpubroker-{model}"]
        ingress = app._bound_deployment  # noqa: SLF001 - the bound graph Serve will deploy
        cards = placement.cards_of(model)
        if len(cards) == 1:
            opts = ingress.ray_actor_options
            assert card_resource(cards[0]) in opts["resources"]  # asks for its card's resource
            assert ingress._name == model  # noqa: SLF001
        else:
            assert ingress.func_or_class.__name__ == "CardRouter"
            groups = ingress.init_args[2]
            assert set(groups) == set(cards)
            for cid, dep in groups.items():
                assert card_resource(cid) in dep._bound_deployment.ray_actor_options["resources"]  # noqa: SLF001
                assert dep._bound_deployment.init_args[2] == cid  # noqa: SLF001 - the replica knows its card
