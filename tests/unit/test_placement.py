"""gpubroker.quotas.placement: first-fit decreasing of the bases, replicas spread over cards and nodes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpubroker.quotas.cards import Card, CardBudget, CardDevice
from gpubroker.quotas.config import load_config
from gpubroker.quotas.placement import ModelDemand, PlacementError, place, place_fleet

MIB = 1024**2
NO_RESERVE = CardBudget(reserve_frac=0.0, context_bytes_per_process=0)


def card(cid: str, node: str, cap_mib: int = 1000, device: CardDevice = CardDevice.CPU, **labels: str) -> Card:
    return Card(
        cid, node, int(cid[-1]) if cid[-1].isdigit() else 0, device, cap_mib * MIB, tuple(sorted(labels.items()))
    )


def demand(name: str, base_mib: int, replicas: int = 1, **kw) -> ModelDemand:
    return ModelDemand(name, base_mib * MIB, base_mib * MIB // 2, base_mib * MIB * 2, replicas, **kw)


FOUR = (card("a0", "a"), card("a1", "a"), card("b0", "b"), card("b1", "b"))


def test_first_fit_decreasing_packs_the_largest_base_first():
    p = place([demand("s", 100), demand("l", 700), demand("m", 300)], FOUR, NO_RESERVE)
    # l (700) -> a0; m (300) fits a0 next to it; s (100) no longer fits a0 -> a1
    assert p.replicas == {"l": ("a0",), "m": ("a0",), "s": ("a1",)}
    assert p.card_plan("a0").base_bytes == 1000 * MIB and p.card_plan("a0").free_bytes == 0
    assert dict(p.models_on("a0")) == {"l": 1, "m": 1}


def test_replicas_spread_over_nodes_before_cards_of_the_same_node():
    p = place([demand("x", 100, replicas=3)], FOUR, NO_RESERVE)
    assert p.replicas["x"] == ("a0", "b0", "a1")
    assert {g.card_id: g.replicas for g in p.groups()} == {"a0": 1, "a1": 1, "b0": 1}


def test_replicas_share_their_card_when_no_new_card_has_room_for_the_base():
    cards = (card("a0", "a", 500), card("b0", "b", 500))
    p = place([demand("big", 450), demand("x", 300, replicas=3)], cards, NO_RESERVE)
    # big on a0; x's first on b0; a0 has 50 free < 300, so x's others join it on b0 (no new base)
    assert p.replicas["x"] == ("b0", "b0", "b0")
    assert p.card_plan("b0").base_bytes == 300 * MIB and p.card_plan("b0").processes == 3


def test_spread_false_keeps_replicas_together():
    p = place([demand("x", 100, replicas=3, spread=False)], FOUR, NO_RESERVE)
    assert p.replicas["x"] == ("a0", "a0", "a0")
    assert [(g.model, g.card_id, g.replicas) for g in p.groups()] == [("x", "a0", 3)]
    assert p.groups_of("x") == {"a0": 3} and p.groups_of("not-placed") == {}


def test_every_model_gets_its_first_replica_before_any_spreads():
    cards = (card("a0", "a", 1000), card("b0", "b", 1000))
    # x spreading to b0 first would leave y no room; the bases come first
    p = place([demand("x", 600, replicas=2), demand("y", 500)], cards, NO_RESERVE)
    assert p.replicas == {"x": ("a0", "a0"), "y": ("b0",)}


def test_allowed_cards_and_node_labels_restrict_placement():
    cards = (card("a0", "a", zone="east"), card("b0", "b", zone="west"), card("b1", "b", zone="west"))
    p = place(
        [demand("w", 100, replicas=2, node_label=(("zone", "west"),)), demand("p", 100, cards=("b1",))],
        cards,
        NO_RESERVE,
    )
    assert set(p.replicas["w"]) == {"b0", "b1"} and p.replicas["p"] == ("b1",)


def test_cuda_context_counts_per_process_on_real_cards():
    budget = CardBudget(reserve_frac=0.0, context_bytes_per_process=100 * MIB)
    cards = (card("g0", "n", 1000, CardDevice.CUDA),)
    p = place([demand("x", 500, replicas=3, spread=False)], cards, budget)
    assert p.card_plan("g0").usable_bytes == 700 * MIB  # three processes' contexts
    with pytest.raises(PlacementError) as err:
        place([demand("x", 500, replicas=6, spread=False)], cards, budget)
    assert err.value.model == "x" and "replica 6 of 6" in str(err.value)


def test_error_names_model_need_and_each_cards_free_bytes():
    with pytest.raises(PlacementError) as err:
        place([demand("a", 900), demand("b", 900), demand("c", 200)], (card("a0", "a"), card("b0", "b")), NO_RESERVE)
    e = err.value
    assert e.model == "c" and e.need_bytes == 200 * MIB and e.free_bytes == {"a0": 100 * MIB, "b0": 100 * MIB}
    assert "models.c" in str(e) and "a0 (node a) 100.0MiB free" in str(e)


def test_unknown_card_and_unmatched_label_are_errors():
    with pytest.raises(PlacementError, match="card 'zz' is not a card of the fleet"):
        place([demand("a", 1, cards=("zz",))], FOUR, NO_RESERVE)
    with pytest.raises(PlacementError, match="no card matches"):
        place([demand("a", 1, node_label=(("gpu", "h100"),))], FOUR, NO_RESERVE)


def test_cluster_demo_config_is_placed_over_every_card():
    cfg = load_config("configs/cluster-demo.yaml")
    p = place_fleet(cfg)
    assert all(plan.base_bytes <= plan.usable_bytes for plan in p.cards)
    assert all(plan.models for plan in p.cards), p.to_dict()
    for name, spec in cfg.models.items():
        assert len(p.replicas[name]) == spec.replicas
    spread = [n for n, s in cfg.models.items() if s.replicas > 1]
    assert spread and all(len({p.card(c).node for c in p.replicas[n]}) == 2 for n in spread)


def test_placement_of_a_one_card_config_is_card0():
    p = place_fleet(load_config("configs/demo.yaml"))
    assert {c for ids in p.replicas.values() for c in ids} == {"card0"}


# --------------------------------------------------------------------------- properties
@st.composite
def fleets(draw):
    n_nodes = draw(st.integers(1, 3))
    cards = []
    for n in range(n_nodes):
        for i in range(draw(st.integers(1, 3))):
            cards.append(
                Card(
                    f"n{n}c{i}",
                    f"node{n}",
                    i,
                    draw(st.sampled_from([CardDevice.CPU, CardDevice.CUDA])),
                    draw(st.integers(200, 2000)) * MIB,
                )
            )
    demands = [
        ModelDemand(f"m{k}", b * MIB, b * MIB, b * MIB, draw(st.integers(1, 4)), spread=draw(st.booleans()))
        for k, b in enumerate(draw(st.lists(st.integers(1, 600), min_size=1, max_size=8)))
    ]
    budget = CardBudget(
        reserve_frac=draw(st.sampled_from([0.0, 0.12])), context_bytes_per_process=draw(st.sampled_from([0, 50 * MIB]))
    )
    return tuple(cards), demands, budget


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_property_within_usable_complete_deterministic_and_spread(fleet):
    cards, demands, budget = fleet
    try:
        p = place(demands, cards, budget)
    except PlacementError as exc:
        assert exc.model in {d.name for d in demands}
        with pytest.raises(PlacementError):  # deterministic failures too
            place(list(reversed(demands)), cards, budget)
        return
    assert p == place(list(reversed(demands)), cards, budget)  # input order does not matter
    for plan in p.cards:
        assert plan.base_bytes <= plan.usable_bytes
        assert plan.usable_bytes == budget.usable_bytes(plan.card, plan.processes)
        assert plan.base_bytes == sum(d.base_bytes for d in demands if d.name in plan.models)
    for d in demands:
        ids = p.replicas[d.name]
        assert len(ids) == d.replicas
        if not d.spread:
            assert len(set(ids)) == 1
            continue
        # spread when possible: replicas share a card (or a node) only if no card the model is
        # not on had room for its base at the end (room only shrinks as placement goes on)
        for plan in p.cards:
            if d.name in plan.models:
                continue
            room = budget.usable_bytes(plan.card, plan.processes + 1) - plan.base_bytes
            assert not (room >= d.base_bytes and len(set(ids)) < len(ids)), (d, plan)
            on_nodes = {p.card(c).node for c in ids}
            if plan.card.node not in on_nodes:
                assert not (room >= d.base_bytes and len(on_nodes) < len(set(ids))), (d, plan)


# --------------------------------------------------------------------------- as Ray resources
def test_deployment_plans_name_groups_and_share_each_card_resource():
    from gpubroker.deployments.serve.placement_resources import deployment_plans

    p = place_fleet(load_config("configs/cluster-demo.yaml"))
    plans = {plan.name: plan for plan in deployment_plans(p, model_num_cpus=0.1)}
    assert set(plans) == {"cnn@a1", "cnn@b1", "minilm@a0", "minilm@b0", "mlp", "profiled"}
    # a0 holds two replica processes (minilm, mlp): each asks half of its card resource
    assert plans["mlp"].ray_actor_options["resources"] == {"gpubroker_card_a0": 500.0}
    assert plans["minilm@b0"].ray_actor_options["resources"] == {"gpubroker_card_b0": 1000.0}
    assert plans["minilm@b0"].ray_actor_options["runtime_env"]["env_vars"]["GPUBROKER_CARD_ID"] == "b0"
    assert "num_gpus" not in plans["mlp"].ray_actor_options  # emulated cards ask for no GPU


def test_one_card_fleet_keeps_todays_names_and_options():
    from gpubroker.deployments.serve.placement_resources import deployment_plans

    cfg = load_config("configs/demo.yaml")
    plans = deployment_plans(place_fleet(cfg), model_num_cpus=0.1)
    assert sorted(pl.name for pl in plans) == sorted(cfg.models)
    assert all(pl.ray_actor_options == {"num_cpus": 0.1} for pl in plans)


def test_cuda_replica_asks_a_gpu_share_and_sees_its_card():
    from gpubroker.deployments.serve.placement_resources import replica_actor_options

    opts = replica_actor_options(Card("g1", "n", 1, CardDevice.CUDA, 1), replicas_on_card=3, num_cpus=1)
    assert opts["resources"] == {"gpubroker_card_g1": 333.0} and opts["num_gpus"] == 0.333
    env = opts["runtime_env"]["env_vars"]
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    found = Card("h-gpu0", "h", 0, CardDevice.CUDA, 1, node_id="abc")
    opts = replica_actor_options(found, replicas_on_card=1, num_cpus=1)
    assert opts["label_selector"] == {"ray.io/node-id": "abc"} and "resources" not in opts


def test_node_start_args_declare_the_nodes_cards_and_labels():
    from gpubroker.deployments.serve.placement_resources import node_start_args
    from gpubroker.quotas.cards import fleet_cards

    cfg = load_config("configs/cluster-demo.yaml")
    args = node_start_args("node-b", fleet_cards(cfg.gpu, cfg.gpus))
    assert args == [
        "--resources",
        '{"gpubroker_card_b0": 1000, "gpubroker_card_b1": 1000}',
        "--labels",
        "gpubroker.io/node=node-b,zone=west",
    ]


def test_discover_cards_from_ray_nodes_and_nvml_totals():
    from gpubroker.deployments.cluster.discovery import DiscoveryError, card_nodes, discover_cards

    nodes = [
        {
            "NodeID": "n2" * 20,
            "Alive": True,
            "NodeName": "10.0.0.2",
            "Resources": {"CPU": 8, "GPU": 2},
            "Labels": {"ray.io/node-id": "x", "zone": "west"},
        },
        {"NodeID": "n1" * 20, "Alive": True, "NodeName": "10.0.0.1", "Resources": {"CPU": 8}, "Labels": {}},
        {"NodeID": "n3" * 20, "Alive": False, "NodeName": "10.0.0.3", "Resources": {"GPU": 8}, "Labels": {}},
        {
            "NodeID": "n4" * 20,
            "Alive": True,
            "NodeName": "10.0.0.4",
            "Resources": {"GPU": 1, "gpubroker_card_e0": 1000},
            "Labels": {"gpubroker.io/node": "edge"},
        },
    ]
    cards = discover_cards(nodes, capacity_probe=lambda node_id, n: [80 * 1024**3] * n)
    assert [(c.id, c.node, c.index, c.node_id[:2]) for c in cards] == [
        ("10-0-0-2-gpu0", "10.0.0.2", 0, "n2"),
        ("10-0-0-2-gpu1", "10.0.0.2", 1, "n2"),
        ("edge-gpu0", "edge", 0, "n4"),
    ]
    assert cards[0].label_map == {"zone": "west"} and cards[0].capacity_bytes == 80 * 1024**3
    assert card_nodes(nodes) == {"e0": "n4" * 20}

    def no_nvml(node_id, n):
        raise RuntimeError("NVML Shared Library Not Found")

    with pytest.raises(DiscoveryError, match="node 10.0.0.2 .* list its cards under gpus"):
        discover_cards(nodes, capacity_probe=no_nvml)


# --------------------------------------------------------------------------- node loss and join
def test_after_a_node_loss_survivors_stay_and_lost_replicas_go_where_there_is_room():
    from gpubroker.quotas.placement import replace_after_loss

    demands = [demand("x", 300, replicas=2), demand("y", 600), demand("z", 500, cards=("b0",))]
    before = place(demands, FOUR, NO_RESERVE)
    assert before.replicas == {"x": ("a0", "b0"), "y": ("a0",), "z": ("b0",)}
    alive = tuple(c for c in FOUR if c.node == "a")
    after = replace_after_loss(before, demands, alive, NO_RESERVE)
    assert after.replicas["y"] == before.replicas["y"]  # y ran on node a: it stays
    assert after.replicas["x"] == ("a0", "a1")  # its a0 replica stays; the lost one spreads to a1
    assert after.unplaced == {"z": 1} and after.replicas["z"] == ()  # z may only run on b0, which is gone
    assert all(p.base_bytes <= p.usable_bytes for p in after.cards)
    rejoined = replace_after_loss(after, demands, FOUR, NO_RESERVE)  # node b is back
    assert rejoined.unplaced == {} and rejoined.replicas["z"] == ("b0",)
    assert rejoined.replicas["y"] == after.replicas["y"]  # no live migration


@settings(max_examples=200, deadline=None)
@given(fleets(), st.integers(0, 2))
def test_property_replacing_after_a_node_loss_keeps_survivors_and_never_overgrants(fleet, lost_node):
    from collections import Counter

    from gpubroker.quotas.placement import replace_after_loss

    cards, demands, budget = fleet
    try:
        before = place(demands, cards, budget)
    except PlacementError:
        return
    alive = tuple(c for c in cards if c.node != f"node{lost_node}")
    after = replace_after_loss(before, demands, alive, budget)
    alive_ids = {c.id for c in alive}
    for d in demands:
        kept = Counter(c for c in before.replicas[d.name] if c in alive_ids)
        now = Counter(after.replicas[d.name])
        assert all(now[c] >= n for c, n in kept.items())  # survivors stay where they run
        assert len(after.replicas[d.name]) + after.unplaced.get(d.name, 0) == d.replicas
    for plan in after.cards:
        assert plan.card.id in alive_ids and plan.base_bytes <= plan.usable_bytes


def test_fleet_plans_of_a_one_card_fleet_need_no_capacity():
    from gpubroker.deployments.serve.placement_resources import fleet_plans
    from gpubroker.quotas.config import parse_config

    cfg = parse_config(
        {"models": {"a": {"model": "mlp", "replicas": 2, "quota": {"min": "1MiB", "base": "2MiB", "max": "3MiB"}}}}
    )
    assert cfg.gpu.capacity == "auto"
    (plan,) = fleet_plans(cfg, model_num_cpus=0.1)
    assert (plan.name, plan.card_id, plan.num_replicas, plan.ray_actor_options) == ("a", "card0", 2, {"num_cpus": 0.1})
    demo = load_config("configs/cluster-demo.yaml")
    assert {p.name for p in fleet_plans(demo, model_num_cpus=0.1)} == {
        "cnn@a1",
        "cnn@b1",
        "minilm@a0",
        "minilm@b0",
        "mlp",
        "profiled",
    }
