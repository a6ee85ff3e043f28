"""Cards in the config: the gpus: section, model placement specs, and their validation errors."""

from __future__ import annotations

import copy

import pytest

from gpubroker.quotas.cards import SINGLE_CARD_ID, Card, CardBudget, CardDevice, fleet_cards
from gpubroker.quotas.config import ConfigError, parse_config
from gpubroker.quotas.sizes import parse_size


def _cards(n_nodes: int = 2, per_node: int = 2, capacity: str = "1GiB") -> list[dict]:
    return [
        {
            "id": f"n{n}c{i}",
            "node": f"node-{n}",
            "index": i,
            "capacity": capacity,
            "device": "cpu",
            "labels": {"zone": "east" if n == 0 else "west"},
        }
        for n in range(n_nodes)
        for i in range(per_node)
    ]


def _doc(**models: dict) -> dict:
    base = {"gpu": {"reserve_frac": 0.12}, "gpus": _cards(), "models": {}}
    for name, extra in (models or {"a": {}}).items():
        base["models"][name] = {"model": "mlp", "quota": {"min": "100MiB", "base": "300MiB", "max": "800MiB"}, **extra}
    return base


def _issues(doc: dict) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    return [str(i) for i in err.value.issues]


def test_gpus_list_parses_and_resolves_to_cards():
    cfg = parse_config(_doc(a={"replicas": 2, "placement": {"node_label": {"zone": "west"}}}))
    cards = fleet_cards(cfg.gpu, cfg.gpus)
    assert [c.id for c in cards] == ["n0c0", "n0c1", "n1c0", "n1c1"]
    assert cards[2] == Card("n1c0", "node-1", 0, CardDevice.CPU, 1024**3, (("zone", "west"),))
    assert cards[2].emulated and cards[2].matches({"zone": "west"}) and not cards[2].matches({"zone": "east"})
    assert cfg.models["a"].placement.node_label == {"zone": "west"}


def test_without_gpus_the_gpu_section_is_one_card():
    cfg = parse_config(
        {
            "gpu": {"device": "cpu", "capacity": "2GiB"},
            "models": {"a": {"model": "mlp", "quota": {"min": "1MiB", "base": "2MiB", "max": "3MiB"}}},
        }
    )
    (card,) = fleet_cards(cfg.gpu, cfg.gpus)
    assert card.id == SINGLE_CARD_ID and card.capacity_bytes == 2 * 1024**3 and card.emulated
    assert cfg.models["a"].placement.cards == "any"


def test_gpus_auto_is_accepted_and_needs_discovered_cards():
    doc = _doc()
    doc["gpus"] = "auto"
    cfg = parse_config(doc)
    with pytest.raises(ValueError, match="discover_cards"):
        fleet_cards(cfg.gpu, cfg.gpus)
    found = (Card("h-gpu0", "h", 0, CardDevice.CUDA, 16 * 1024**3),)
    assert fleet_cards(cfg.gpu, cfg.gpus, discovered=found) == found


def test_budget_subtracts_the_context_only_on_real_cards():
    budget = CardBudget(reserve_frac=0.5, context_bytes_per_process=10)
    assert budget.usable_bytes(Card("x", "n", 0, CardDevice.CUDA, 1000), processes=3) == 470
    assert budget.usable_bytes(Card("y", "n", 0, CardDevice.CPU, 1000), processes=3) == 500


def test_repeated_card_id_names_both_entries():
    doc = _doc()
    doc["gpus"][1]["id"] = "n0c0"
    (issue,) = _issues(doc)
    assert "gpus[1].id 'n0c0' repeats gpus[0]" in issue
    assert issue.startswith("gpus: ") and "got [" not in issue  # the message names the entry, not the whole list


def test_two_cards_on_one_node_index_are_refused():
    doc = _doc()
    doc["gpus"][1]["index"] = 0
    (issue,) = _issues(doc)
    assert "both index 0 on node node-0" in issue and "n0c1" in issue


def test_bad_card_id_and_missing_capacity():
    doc = _doc()
    doc["gpus"][0]["id"] = "Card 0"
    del doc["gpus"][1]["capacity"]
    issues = _issues(doc)
    assert any("card id 'Card 0' is not allowed" in i for i in issues)
    assert any("gpus.1.capacity" in i and "missing" in i for i in issues)


def test_gpu_capacity_beside_gpus_is_refused():
    doc = _doc()
    doc["gpu"]["capacity"] = "1GiB"
    (issue,) = _issues(doc)
    assert issue.startswith("gpu.capacity") and "leave gpu.capacity and gpu.device at auto" in issue


def test_unknown_card_in_placement_names_model_and_card():
    (issue,) = _issues(_doc(a={"placement": {"cards": ["n0c0", "zz9"]}}))
    assert "models.a.placement.cards" in issue and "'zz9'" in issue and "n1c1" in issue


def test_node_label_that_matches_nothing_names_the_model():
    (issue,) = _issues(_doc(a={"placement": {"node_label": {"zone": "north"}}}))
    assert "models.a.placement" in issue and "no card matches" in issue and "'zone': 'north'" in issue


def test_model_too_big_for_every_card_names_model_need_and_free():
    (issue,) = _issues(_doc(a={"quota": {"min": "100MiB", "base": "950MiB", "max": "1GiB"}}))
    assert issue.startswith("models.a")
    assert "950.0MiB" in issue and "n0c0 (node node-0)" in issue and "901.1MiB free" in issue


def test_sum_of_bases_per_card_over_usable_is_refused():
    # each card is usable 1GiB x 0.88 = 901MiB: two 450MiB models fit a card, the 9th such model fits nowhere
    models = {f"m{i}": {"quota": {"min": "100MiB", "base": "450MiB", "max": "800MiB"}} for i in range(9)}
    (issue,) = _issues(_doc(**models))
    assert issue.startswith("models.m8") and "its first replica" in issue and "1.1MiB free" in issue
    del models["m8"]
    parse_config(_doc(**models))


def test_empty_placement_cards_list_is_refused():
    (issue,) = _issues(_doc(a={"placement": {"cards": []}}))
    assert "placement.cards is an empty list" in issue


def test_config_hash_of_a_gpus_fleet_follows_the_cards():
    doc = _doc()
    other = copy.deepcopy(doc)
    other["gpus"][0]["capacity"] = "2GiB"
    assert parse_config(doc).config_hash() != parse_config(other).config_hash()
    assert parse_size(parse_config(doc).model_dump(mode="json")["gpus"][0]["capacity"]) == 1024**3


def test_gpus_string_other_than_auto_says_the_forms():
    doc = _doc()
    doc["gpus"] = "all"
    (issue,) = _issues(doc)
    assert "'all' is not a gpus form" in issue and "gpus: auto" in issue
