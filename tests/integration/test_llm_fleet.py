"""One fleet, one batch model and one LLM (vLLM), on real Ray Serve: both serve, the broker drives the engine.

The fleet comes up the way ``gpubroker up`` brings it up (``gpubroker.deployments.cluster.fleet.deploy``): the
broker actor, the batch model's app, the OpenAI app at ``/openai``. The LLM server reports
through the same report/reply path as the batch replica; the bounds the broker logs are the
ones the engine runs. One Ray instance for the module.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration._fleet import local_fleet
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")  # make test runs it in .venv-vllm

CONFIG = """
broker:
  name: gpubroker-llm-test
  namespace: gpubroker-llm-test
  control_interval_s: 0.5
  report_interval_s: 0.25
  metrics_port: 0
  http_host: 127.0.0.1
  http_port: 8000
gpu: {device: cpu, capacity: 1GiB, reserve_frac: 0.12, emergency_free_frac: 0.05}
models:
  mlp:
    model: mlp
    quota: {min: 128MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 2, ceiling: 16}
    slo_p95_ms: 2000
  chat:
    kind: llm
    model: tiny-llama
    options: {max_model_len: 128, kv_cache_blocks: 4, kv_cache_blocks_min: 2, kv_cache_blocks_max: 8, max_num_seqs: 2, max_num_seqs_max: 16}
    llm: {expected_peak_concurrency: 12, ttft_slo_ms: 5000, tpot_slo_ms: 1000}
    quota: {min: 64MiB, base: 192MiB, max: 384MiB}
"""


@pytest.fixture(scope="module")
def fleet():
    with local_fleet(CONFIG) as (url, broker, cfg):
        yield url, broker


def _status(broker) -> dict:
    import ray

    return ray.get(broker.status.remote(), timeout=30)


def test_batch_model_and_llm_both_serve(fleet):
    url, _ = fleet
    r = httpx.post(f"{url}/v1/models/mlp/infer", json={"input": {"x": [0.1] * 64}}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{url}/openai/v1/completions", json={"model": "chat", "prompt": "hello", "max_tokens": 8}, timeout=120
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] >= 1
    with httpx.stream(
        "POST",
        f"{url}/openai/v1/chat/completions",
        timeout=120,
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True},
    ) as s:
        assert s.status_code == 200
        events = [line[len("data: ") :] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"
    r = httpx.post(
        f"{url}/openai/v1/completions", json={"model": "chat", "prompt": "x" * 120, "max_tokens": 8}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_broker_sets_the_engines_bounds_through_the_reply(fleet):
    url, broker = fleet

    def applied():
        st = _status(broker)["models"]["chat"]
        eng = st.get("engine") or {}
        stats = httpx.get(f"{url}/openai/v1/llm/chat/stats", timeout=60).json()
        bounds = stats.get("broker_bounds") or {}
        return (
            eng.get("reporting")
            and eng.get("max_num_seqs") is not None
            and bounds.get("max_num_seqs") == eng["max_num_seqs"] == stats["max_num_seqs"]
        ) and (eng, stats)

    eng, stats = wait_for(
        applied, timeout_s=120, interval_s=1.0, what="the broker's engine bounds on the running engine"
    )
    # config start was max_num_seqs 2; the broker's start rule sets half the expected peak of 12
    assert eng["max_num_seqs"] == 6 == stats["max_num_seqs"]
    entries = ray_decisions(broker, "chat")
    assert any(
        e["kind"] == "engine" and e["rule"] == "start" and e["trigger"] == "expected_peak_concurrency" for e in entries
    )
    st = _status(broker)
    assert "engine" not in st["models"]["mlp"]  # the batch model stays a batch model
    assert st["models"]["chat"]["kind"] == "llm"
    assert st["models"]["chat"]["replicas"] == 1  # the LLM server reports like any replica


def ray_decisions(broker, model: str) -> list[dict]:
    import ray

    return ray.get(broker.decisions.remote(model), timeout=30)
