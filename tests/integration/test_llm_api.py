"""The OpenAI-compatible API on real Ray Serve + HTTP, two vLLM engines from configs/llm-demo.yaml,
called with the ``openai`` Python client (``base_url`` at the app) and with raw HTTP where the
wire itself is the point (SSE framing). Skipped without vLLM (``make test`` runs it in ``.venv-vllm``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("vllm")

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "llm-demo.yaml"


@pytest.fixture(scope="module")
def url():
    import ray
    from ray import serve

    from gpubroker.deployments.cluster.local_ray import free_port
    from gpubroker.deployments.llm.openai_api import build_llm_app

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_llm_app({"config": str(CONFIG)}), name="llm", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)


def sse_events(url: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


def stats(url: str, model: str) -> dict:
    r = httpx.get(f"{url}/v1/llm/{model}/stats", timeout=60)
    assert r.status_code == 200
    return r.json()


def test_models_list(client):
    assert sorted(m.id for m in client.models.list().data) == ["chat", "code"]


def test_completion_its_usage_and_its_stream_agree(client, url):
    out = client.completions.create(model="chat", prompt="Once upon a time", max_tokens=20)
    assert out.object == "text_completion" and out.model == "chat"
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len("Once upon a time") + 1  # byte tokens and <s>
    assert 1 <= out.usage.completion_tokens <= 20
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    again = client.completions.create(model="chat", prompt="Once upon a time", max_tokens=20)
    assert again.choices[0].text == out.choices[0].text  # greedy
    chunks = list(client.completions.create(model="chat", prompt="Once upon a time", max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
    events = sse_events(url, "/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 4, "stream": True})
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "text_completion"


def test_chat_completion_uses_the_chat_template_and_streams(client):
    messages = [{"role": "user", "content": "write a loop"}]
    out = client.chat.completions.create(model="code", messages=messages, max_tokens=12)
    assert out.object == "chat.completion" and out.model == "code"
    assert out.choices[0].message.role == "assistant"
    # <s>user: write a loop<sep>assistant: -> 1 + 18 + 1 + 11 tokens
    assert out.usage.prompt_tokens == 1 + len("user: write a loop") + 1 + len("assistant: ")
    chunks = list(client.chat.completions.create(model="code", messages=messages, max_tokens=12, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content


def test_stop_ends_the_text_before_the_stop_string(client):
    full = client.completions.create(model="chat", prompt="stop here", max_tokens=32).choices[0].text
    usable = [ch for ch in full[1:] if ch != "\ufffd"]  # random weights: mostly broken UTF-8
    assert usable, f"no usable stop string in {full!r}"
    cut = client.completions.create(model="chat", prompt="stop here", max_tokens=32, stop=[usable[-1]])
    assert cut.choices[0].finish_reason == "stop" and usable[-1] not in cut.choices[0].text


def test_over_the_context_is_400_naming_max_tokens_streaming_or_not(client):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="chat", prompt="x" * 400, max_tokens=200, stream=stream)
        assert err.value.status_code == 400
        body = err.value.body
        assert body["param"] == "max_tokens" and "512" in body["message"]


def test_unknown_model_is_404_naming_the_known_ones(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="hi", max_tokens=4)
    assert err.value.body["param"] == "model" and "chat" in err.value.body["message"]


def test_bad_bodies_name_the_field(url):
    r = httpx.post(url + "/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(url + "/v1/chat/completions", json={"model": "chat", "messages": []}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_closing_a_stream_cancels_its_sequence(url):
    before = stats(url, "chat")
    body = {"model": "chat", "prompt": "tell me a long story", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(4)) if line.startswith("data: ")]
        assert got
    deadline = time.monotonic() + 120  # polling bound, not an assertion on speed
    s = stats(url, "chat")
    while time.monotonic() < deadline and not (s["cancelled"] > before["cancelled"] and s["running"] == 0):
        time.sleep(0.2)
        s = stats(url, "chat")
    assert s["cancelled"] == before["cancelled"] + 1 and s["running"] == 0


def test_stats_report_bounds_and_vllm_signals(url):
    s = stats(url, "chat")
    assert (s["max_num_seqs"], s["kv_blocks_total"], s["max_model_len"], s["kv_block_tokens"]) == (8, 8, 512, 128)
    assert s["finished"] >= 1 and s["ttft_p95_ms"] is not None and s["kv_cache_bytes"] == 8 * s["kv_block_bytes"]
    assert s["prefix_cache_queries"] > 0 and "preemptions" in s and "engine_waiting" in s
