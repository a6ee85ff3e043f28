"""The fleet deployed by placement on a 2-node cluster (emulated cards): one broker, a ledger per card.

``mlp`` has a replica on each node's card, so its app is a ``CardRouter`` over two deployments;
``prof`` lives on one card. Requests answer through the router; every replica registers with
its card, so the broker's status shows each card with its own grant for ``mlp``, and each
card's grants stay within its usable memory.
"""

from __future__ import annotations

import httpx
import pytest

from tests.cluster.harness import deployed_fleet, wait_until

pytestmark = pytest.mark.integration

CONFIG = """
broker: {name: cards, namespace: cards, control_interval_s: 0.5, report_interval_s: 0.25, metrics_port: 0}
gpu: {reserve_frac: 0.0}
gpus:
  - {id: a0, node: node-a, index: 0, capacity: 512MiB, device: cpu}
  - {id: b0, node: node-b, index: 0, capacity: 512MiB, device: cpu}
models:
  mlp:
    model: mlp
    quota: {min: 64MiB, base: 160MiB, max: 256MiB}
    batch: {floor: 2, ceiling: 32}
    slo_p95_ms: 2000
    replicas: 2
  prof:
    model: profiled
    options: {a_ms: 2, c_ms: 0.1}
    quota: {min: 32MiB, base: 96MiB, max: 128MiB}
    slo_p95_ms: 2000
    placement: {cards: [a0]}
"""


@pytest.fixture(scope="module")
def fleet():
    with deployed_fleet(CONFIG, "cards") as (_, url, broker):
        yield url, broker


def test_a_model_on_two_cards_answers_and_each_card_holds_its_grant(fleet):
    import ray

    url, broker = fleet
    body = {"inputs": [{"x": [0.5] * 64}] * 2}
    with httpx.Client(timeout=30) as client:
        for _ in range(20):
            r = client.post(f"{url}/v1/models/mlp/infer", json=body)
            assert r.status_code == 200, r.text
            assert len(r.json()["outputs"]) == 2
        bad = client.post(f"{url}/v1/models/mlp/infer", json={"inputs": [{"x": [1, 2]}]})
        assert bad.status_code == 422 and "inputs[0].x" in bad.text  # the router checks like a replica
        assert client.post(f"{url}/v1/models/prof/infer", json={"inputs": [{}]}).status_code == 200

    def cards_reported():
        st = ray.get(broker.status.remote())
        cards = {c["id"]: c for c in st["cards"]}
        mlp = [cards[c]["models"].get("mlp", {}).get("replicas", 0) for c in ("a0", "b0")]
        return st if mlp == [1, 1] and cards["a0"]["models"]["prof"]["replicas"] == 1 else None

    st = wait_until(cards_reported, timeout_s=60, what="every replica reporting on its card")
    for card in st["cards"]:
        assert card["granted_bytes"] <= card["usable_bytes"]
        assert card["models"]["mlp"]["grant_bytes"] >= 160 * 1024**2  # its base, on each card it is on
    assert "prof" not in {c["id"]: c for c in st["cards"]}["b0"]["models"]
    assert st["models"]["mlp"]["cards"] == ["a0", "b0"]
