"""gpubroker.quotas.card_fleet: one card of a listed gpus: fleet as a one-card fleet (simulate --card)."""

from __future__ import annotations

import copy

import pytest

from gpubroker.quotas.card_fleet import card_fleet
from gpubroker.quotas.config import load_config, parse_config
from gpubroker.quotas.placement import place_fleet


@pytest.fixture(scope="module")
def cluster():
    return load_config("configs/cluster-demo.yaml")


def test_each_card_keeps_its_models_replicas_and_budget(cluster):
    placement = place_fleet(cluster)
    for plan in placement.cards:
        one = card_fleet(cluster, plan.card.id)
        assert one.gpus is None and one.gpu.capacity_bytes == plan.card.capacity_bytes and one.gpu.device == "cpu"
        assert {m: s.replicas for m, s in one.models.items()} == dict(plan.models)
        assert one.usable_bytes() == plan.usable_bytes  # the same budget the card's ledger starts from
        for name, spec in one.models.items():  # quotas, batching and SLO as the fleet has them
            assert spec.quota == cluster.models[name].quota and spec.batch == cluster.models[name].batch
        assert one.gpu.reserve_frac == cluster.gpu.reserve_frac


def test_a_cuda_card_becomes_its_ordinal(cluster):
    doc = copy.deepcopy(cluster.model_dump(mode="json"))
    for card in doc["gpus"]:
        card.update(device="cuda", capacity="8GiB")  # room for a CUDA context per replica
    doc["gpus"][2]["index"] = 3  # b0 as node-b's fourth GPU
    one = card_fleet(parse_config(doc), "b0")
    assert one.gpu.device == "cuda:3" and one.gpu.capacity_bytes == 8 * 1024**3


def test_refusals_name_the_fix(cluster):
    with pytest.raises(ValueError, match="use one of a0, a1, b0, b1"):
        card_fleet(cluster, "zz")
    with pytest.raises(ValueError, match="leave out --card"):
        card_fleet(load_config("configs/demo.yaml"), "a0")
    doc = cluster.model_dump(mode="json")
    doc["gpus"] = "auto"
    with pytest.raises(ValueError, match="list the cards under gpus"):
        card_fleet(parse_config(doc), "a0")
    doc = copy.deepcopy(cluster.model_dump(mode="json"))
    doc["gpus"].append({"id": "c0", "node": "node-c", "index": 0, "capacity": "1GiB", "device": "cpu"})
    with pytest.raises(ValueError, match="no model is placed on card c0"):
        card_fleet(parse_config(doc), "c0")
