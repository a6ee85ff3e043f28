"""LLM engines on a fleet of cards (``gpubroker.deployments.llm.openai_api.llm_spots``, ``gpubroker.deployments.serve.reconcile``),
no Ray running: what the bound Serve deployments ask Ray for.

Three cards on two nodes, listed a0 (node-a), b0 (node-b), a1 (node-a). ``chat_a`` may run on a0
only, ``chat_b`` on b0 or a1 (first fit puts it on b0), ``chat_c`` on b0 only. At deploy time
each engine asks for its card's resource and names its card. When node-b is lost, the LLM app is
deployed again: chat_b pinned to a1's node by label, chat_a and the ingress exactly as deployed
(same versions: Serve leaves them running), chat_c reported unplaced.
"""

from __future__ import annotations

from gpubroker.broker.fleet_core import FleetBroker
from gpubroker.deployments.llm.openai_api import LLM_NUM_CPUS, llm_app
from gpubroker.deployments.serve.placement_resources import CARD_ENV, NODE_LABEL, card_resource
from gpubroker.deployments.serve.reconcile import ServeReconciler, moved_actor_options
from gpubroker.quotas.config import parse_config_text
from gpubroker.quotas.placement import place_fleet

ENGINE = "options: {max_model_len: 256, kv_cache_blocks: 4, kv_cache_blocks_min: 3, max_num_seqs_max: 8}"
CONFIG = f"""
broker: {{name: lp, namespace: lp, control_interval_s: 1.0, report_interval_s: 0.5, metrics_port: 0}}
gpu: {{reserve_frac: 0.0}}
gpus:
  - {{id: a0, node: node-a, index: 0, capacity: 512MiB, device: cpu}}
  - {{id: b0, node: node-b, index: 0, capacity: 512MiB, device: cpu}}
  - {{id: a1, node: node-a, index: 1, capacity: 512MiB, device: cpu}}
models:
  mlp:
    model: profiled
    quota: {{min: 32MiB, base: 96MiB, max: 160MiB}}
    slo_p95_ms: 1500
    placement: {{cards: [a0]}}
  chat_a:
    model: tiny-llama
    kind: llm
    {ENGINE}
    quota: {{min: 32MiB, base: 64MiB, max: 128MiB}}
    placement: {{cards: [a0]}}
  chat_b:
    model: tiny-llama
    kind: llm
    {ENGINE}
    quota: {{min: 32MiB, base: 64MiB, max: 128MiB}}
    placement: {{cards: [b0, a1]}}
  chat_c:
    model: tiny-llama
    kind: llm
    {ENGINE}
    quota: {{min: 32MiB, base: 48MiB, max: 96MiB}}
    placement: {{cards: [b0]}}
"""


def _engines(app) -> dict:
    """The bound LlmServer deployments behind the LLM app's ingress, by model."""
    ingress = app._bound_deployment
    return {name: child._bound_deployment for name, child in app._bound_deployment.init_args[0].items()} | {
        "_ingress": ingress
    }


def _deployed():
    cfg = parse_config_text(CONFIG, "llm placement test")
    return cfg, _engines(llm_app(cfg, CONFIG, placement=place_fleet(cfg)))


def test_each_engine_asks_for_its_placed_card_and_names_it():
    cfg, engines = _deployed()
    placement = place_fleet(cfg)
    assert placement.replicas["chat_b"] == ("b0",) and placement.replicas["chat_a"] == ("a0",)
    b = engines["chat_b"]
    assert b.ray_actor_options["resources"] == {card_resource("b0"): 500.0}  # chat_b and chat_c share b0
    assert b.ray_actor_options["runtime_env"]["env_vars"][CARD_ENV] == "b0"
    assert b.init_args[0] == "chat_b" and b.init_args[3] == "b0"  # its reports name its card
    a = engines["chat_a"]
    assert a.ray_actor_options["resources"] == {card_resource("a0"): 500.0}  # chat_a and mlp share a0
    assert a.init_args[3] == "a0"
    again = _deployed()[1]
    assert {n: d.version for n, d in again.items()} == {n: d.version for n, d in engines.items()}


def test_a_one_card_fleet_keeps_its_engines_unpinned():
    text = open("configs/llm-demo.yaml", encoding="utf-8").read()
    cfg = parse_config_text(text, "llm-demo")
    engines = _engines(llm_app(cfg, text, placement=place_fleet(cfg, capacity_bytes=8 * 1024**3)))
    chat = next(d for n, d in engines.items() if n != "_ingress")
    assert chat.ray_actor_options == {"num_cpus": LLM_NUM_CPUS} and chat.init_args[3] == ""


def test_after_a_node_loss_only_the_moved_engine_changes():
    cfg, deployed = _deployed()
    fb = FleetBroker(CONFIG)
    fb.enable_replacement()
    fb.observe_cards({"a0", "a1", "b0"})
    fb.observe_cards({"a0", "a1"})
    assert fb.placement.replicas["chat_b"] == ("a1",) and fb.placement.replicas["chat_c"] == ()
    rec = ServeReconciler(parse_config_text(CONFIG), CONFIG, fleet_app="t", model_num_cpus=0.05)
    apps, result = rec.apps_for(fb.plan().groups, fb.plan().unplaced)
    assert [a.name for a in apps] == ["t-openai"]  # mlp did not move: its app is not touched
    assert apps[0].route_prefix == "/openai"
    assert set(result.redeployed) == {"chat_b", "chat_c"} and result.unplaced == ("chat_c",)
    now = _engines(apps[0].app)
    moved = now["chat_b"]
    assert moved.ray_actor_options == moved_actor_options(fb.placement.card("a1"), LLM_NUM_CPUS)
    assert moved.ray_actor_options["label_selector"] == {NODE_LABEL: "node-a"}
    assert moved.init_args[3] == "a1" and moved.version != deployed["chat_b"].version
    for kept in ("chat_a", "chat_c", "_ingress"):  # as deployed: Serve leaves them be (chat_c waits for b0)
        assert now[kept].version == deployed[kept].version
        assert now[kept].ray_actor_options == deployed[kept].ray_actor_options


def test_when_the_node_joins_again_the_moved_engine_stays_and_nothing_restarts():
    """No live migration: chat_b stays on a1 with the options it got at the loss (same version,
    so Serve leaves it running); chat_c is placed back on b0 exactly as deployed."""
    _, deployed = _deployed()
    fb = FleetBroker(CONFIG)
    fb.enable_replacement()
    fb.observe_cards({"a0", "a1", "b0"})
    fb.observe_cards({"a0", "a1"})
    rec = ServeReconciler(parse_config_text(CONFIG), CONFIG, fleet_app="t", model_num_cpus=0.05)
    at_loss = _engines(rec.apps_for(fb.plan().groups, fb.plan().unplaced)[0][0].app)
    rec._cache["current"] = fb.plan().groups  # what __call__ records after deploying
    fb.observe_cards({"a0", "a1", "b0"})
    assert fb.placement.replicas["chat_c"] == ("b0",) and fb.placement.replicas["chat_b"] == ("a1",)
    apps, result = rec.apps_for(fb.plan().groups, fb.plan().unplaced)
    assert result.redeployed == ("chat_c",) and result.unplaced == ()
    now = _engines(apps[0].app)
    assert now["chat_b"].version == at_loss["chat_b"].version  # still on a1, not moved back
    assert now["chat_c"].version == deployed["chat_c"].version  # back on its card as deployed
    assert now["chat_a"].version == deployed["chat_a"].version
