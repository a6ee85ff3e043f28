"""The OpenAI-compatible API on real Ray Serve + HTTP, two tiny LLMs from configs/llm-demo.yaml."""

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

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "llm-demo.yaml"


@pytest.fixture(scope="module")
def url():
    import ray
    from ray import serve

    from deployments.llm.openai_api import build_llm_app
    from deployments.local_ray import free_port

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_llm_app({"config": str(CONFIG)}), name="llm", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
        serve.shutdown()
    finally:
        ray.shutdown()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def sse_events(url: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


def stats(url: str, model: str) -> dict:
    r = httpx.get(f"{url}/v1/llm/{model}/stats", timeout=60)
    assert r.status_code == 200
    return r.json()


def test_completion_and_its_stream_agree_and_end_in_done(url):
    body = {"model": "chat", "prompt": "Once upon a time", "max_tokens": 20}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "chat"
    assert out["choices"][0]["finish_reason"] in ("length", "stop")
    assert 1 <= out["usage"]["completion_tokens"] <= 20
    assert post(url, "/v1/completions", body).json()["choices"][0]["text"] == out["choices"][0]["text"]  # greedy
    events = sse_events(url, "/v1/completions", dict(body, stream=True))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == out["choices"][0]["finish_reason"]


def test_chat_completion_and_stream(url):
    body = {"model": "code", "messages": [{"role": "user", "content": "write a loop"}], "max_tokens": 12}
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == "code"
    assert out["choices"][0]["message"]["role"] == "assistant"
    events = sse_events(url, "/v1/chat/completions", dict(body, stream=True))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == out["choices"][0]["message"]["content"]


def test_over_the_context_is_400_naming_max_tokens_streaming_or_not(url):
    body = {"model": "chat", "prompt": "x" * 200, "max_tokens": 100}  # 201 prompt tokens + 100 > 256
    for stream in (False, True):
        r = post(url, "/v1/completions", dict(body, stream=stream))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and "256" in err["message"]


def test_bad_bodies_name_the_field(url):
    r = post(url, "/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = post(url, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "chat" in r.json()["error"]["message"]
    r = post(url, "/v1/chat/completions", {"model": "chat", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(url, "/v1/completions", {"model": "chat", "prompt": "hi", "temperature": 0.7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_closing_a_stream_cancels_its_sequence_and_frees_its_blocks(url):
    before = stats(url, "chat")
    body = {"model": "chat", "prompt": "tell me a long story", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(4)) if line.startswith("data: ")]
        assert got
    deadline = time.monotonic() + 60  # polling bound, not an assertion on speed
    s = stats(url, "chat")
    while time.monotonic() < deadline and not (
        s["cancelled"] > before["cancelled"] and s["running"] == 0 and s["kv_blocks_used"] == 0
    ):
        time.sleep(0.2)
        s = stats(url, "chat")
    assert s["cancelled"] == before["cancelled"] + 1
    assert s["running"] == 0 and s["kv_blocks_used"] == 0 and s["kv_blocks_reserved"] == 0


def test_models_and_stats_report_bounds(url):
    names = [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
    assert names == ["chat", "code"]
    s = stats(url, "chat")
    assert (s["max_num_seqs"], s["kv_blocks_total"], s["max_model_len"]) == (8, 64, 256)
    assert s["finished"] >= 1 and s["ttft_p95_ms"] is not None and s["kv_cache_bytes"] > 0


# The broker's bounds reach the running engine through the report/reply path only (no call
# into the server): tests/integration/test_llm_fleet.py checks that under a real broker, and
# tests/unit/test_llm_broker_path.py round trip by round trip.
