"""An LLM engine's node dies (2 nodes, 3 emulated cards, vLLM CPU engines on the tiny Llama): it comes back on
a live card and the engine that did not move keeps running.

The fleet of ``tests/unit/test_llm_placement.py`` (what the reconciler deploys there, checked
without Ray): cards a0 (node-a, the head), b0 (node-b), a1 (node-a); ``chat_a`` on a0, ``chat_b``
on b0 (it may run on b0 or a1), ``chat_c`` on b0 only, ``mlp`` on a0. node-b is killed: the broker
marks b0 lost and re-places chat_b on a1 (chat_c fits nowhere: reported unplaced); the reconciler
deploys the LLM app again with chat_b pinned to node-a and chat_a exactly as deployed, so chat_a's
replica is the same actor before and after, and both answer completions.
Slow (about 2 minutes): run by ``make chaos``.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.cluster.harness import deployed_fleet, wait_until
from tests.unit.test_llm_placement import CONFIG

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")  # the engines are vLLM: run it in .venv-vllm (make chaos-llm)


@pytest.fixture(scope="module")
def fleet():
    with deployed_fleet(CONFIG, "llmloss", follow=True) as out:
        yield out


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{url}/openai/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4}, timeout=300
    )


def _replicas(deployment: str) -> set[str]:
    """Serve's replica actors of an LLM deployment, by name (each name holds the replica's id)."""
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in named if f"#llm-{deployment}#" in a["name"]}


@pytest.mark.timeout(2400)  # three vLLM starts, then a fourth after the loss: minutes each on two shared cores
def test_a_lost_engine_comes_back_on_a_live_card_and_the_other_keeps_running(fleet):
    import ray

    cc, url, broker = fleet

    def st() -> dict:
        return ray.get(broker.status.remote(), timeout=10)

    def on(card: str, model: str) -> int:
        c = next(c for c in st()["cards"] if c["id"] == card)
        return c["models"].get(model, {}).get("replicas", 0)

    wait_until(
        lambda: on("a0", "chat_a") and on("b0", "chat_b") and on("b0", "chat_c"), 900, what="engines reporting on cards"
    )
    assert _complete(url, "chat_a").status_code == 200 and _complete(url, "chat_b").status_code == 200
    a_before, b_before = _replicas("chat_a"), _replicas("chat_b")
    assert len(a_before) == 1 and len(b_before) == 1, (a_before, b_before)

    t_kill = time.monotonic()
    cc.kill_node("node-b")
    wait_until(lambda: not next(c for c in st()["cards"] if c["id"] == "b0")["live"], 90, what="b0 lost")
    wait_until(
        lambda: on("a1", "chat_b") >= 1, 900, every_s=1, what="chat_b reporting on a1"
    )  # a vLLM start: minutes here
    t_back = time.monotonic()
    wait_until(lambda: _complete(url, "chat_b").status_code == 200, 300, every_s=1, what="chat_b answering again")
    t_ok = time.monotonic()

    final = st()
    assert final["models"]["chat_b"]["cards"] == ["a1"]
    assert "chat_c" in final["unplaced"] and "no live card" in final["unplaced"]["chat_c"]["reason"]
    assert final["reconcile"]["error"] is None, final["reconcile"]
    assert "chat_b" in final["reconcile"]["last"]["redeployed"]
    assert "chat_a" not in final["reconcile"]["last"]["redeployed"]
    assert _replicas("chat_a") == a_before  # the same replica: it never restarted
    b_after = _replicas("chat_b")
    assert len(b_after) == 1 and b_after != b_before  # a new replica, on node-a: node-b is gone
    assert _complete(url, "chat_a").status_code == 200
    for card in final["cards"]:
        assert card["granted_bytes"] <= card["usable_bytes"], card
    print(  # noqa: T201 - the measured times, for the report (-s)
        f"\nLLM engine node loss: chat_b reporting on a1 {t_back - t_kill:.1f}s after the kill, "
        f"answering {t_ok - t_kill:.1f}s after"
    )
