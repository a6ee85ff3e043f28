"""The OpenAI-compatible API on real Ray Serve + HTTP, two vLLM engines from configs/llm-demo.yaml,
called with the ``openai`` Python client (``base_url`` at the app) and with raw HTTP where the
wire itself is the point (SSE framing): completions and chat, ``n``, ``seed``, ``stop``,
``logprobs``, ``max_completion_tokens``, ``stream_options.include_usage``, and OpenAI's errors
(the client's exception class, ``type``, ``param``, ``code``) for a bad request, an unknown model
and an overloaded engine. Skipped without vLLM (``make test-llm`` runs it in ``.venv-vllm``).
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

    # "code" sheds a request that waited 1 ms for admission (test_an_overloaded_engine_...); its
    # other tests send one request at a time, which never waits
    text = CONFIG.read_text(encoding="utf-8")
    overloadable = text.replace("      seed: 1 ", "      max_queue_wait_ms: 1\n      seed: 1 ", 1)
    assert overloadable != text
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_llm_app({"config_text": overloadable}), name="llm", route_prefix="/")
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
        assert body["code"] == "context_length_exceeded"


def test_unknown_model_is_404_naming_the_known_ones(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="hi", max_tokens=4)
    assert err.value.body["param"] == "model" and "chat" in err.value.body["message"]
    assert (err.value.code, err.value.type) == ("model_not_found", "invalid_request_error")


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


# ------------------------------------------------------------------ more of the OpenAI API (issue 53)
def test_n_choices_each_their_own_and_a_seed_repeats_them(client):
    ask = dict(model="chat", prompt="Once upon", max_tokens=12, n=3, temperature=1.0)
    out = client.completions.create(**ask, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert len(set(texts)) == 3, texts  # sampled at temperature 1: three draws, not one copied
    assert out.usage.prompt_tokens == len("Once upon") + 1  # the prompt counted once, not n times
    assert 3 <= out.usage.completion_tokens <= 36
    again = client.completions.create(**ask, seed=11)
    assert [c.text for c in again.choices] == texts  # the same seed: the same choices, in order
    other = client.completions.create(**ask, seed=12)
    assert [c.text for c in other.choices] != texts
    chat = dict(model="code", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=1.0, seed=5)
    first = client.chat.completions.create(**chat, n=2)
    assert [c.index for c in first.choices] == [0, 1] and all(c.message.role == "assistant" for c in first.choices)
    assert [c.message.content for c in client.chat.completions.create(**chat, n=2).choices] == [
        c.message.content for c in first.choices
    ]


def test_completion_logprobs_count_one_per_token_and_greedy_takes_the_likeliest(client):
    out = client.completions.create(model="chat", prompt="hello", max_tokens=6, logprobs=2)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for mine, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2  # two alternatives (two byte pieces may share a text: one key)
        assert mine <= 0 and mine >= max(top.values()) - 1e-4  # greedy: the chosen one is the likeliest
    assert client.completions.create(model="chat", prompt="hello", max_tokens=6).choices[0].logprobs is None


def test_chat_logprobs_with_top_logprobs_streamed_or_not(client):
    ask = dict(model="chat", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5)
    out = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
    assert out.usage.completion_tokens <= 5  # max_completion_tokens is max_tokens
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and abs(entry.logprob - top[0]) < 1e-4
    chunks = list(client.chat.completions.create(**ask, logprobs=True, top_logprobs=1, stream=True))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_include_usage_sends_one_last_chunk_with_the_usage_and_no_choices(client):
    ask = dict(model="chat", messages=[{"role": "user", "content": "count"}], max_tokens=10, n=2)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    with_usage = [i for i, c in enumerate(chunks) if c.usage is not None]
    assert with_usage == [len(chunks) - 1] and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()  # greedy: the same tokens either way
    ends = [(ch.index, ch.finish_reason) for c in chunks[:-1] for ch in c.choices if ch.finish_reason]
    assert sorted(i for i, _ in ends) == [0, 1]  # each choice ends once
    plain = list(client.completions.create(model="chat", prompt="hi", max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain)


def test_stop_and_max_completion_tokens_in_chat(client):
    ask = dict(model="chat", messages=[{"role": "user", "content": "go"}], max_completion_tokens=24)
    full = client.chat.completions.create(**ask).choices[0].message.content
    usable = [ch for ch in full[1:] if ch != "\ufffd"]
    assert usable, f"no usable stop string in {full!r}"
    cut = client.chat.completions.create(**ask, stop=usable[-1]).choices[0]
    assert cut.finish_reason == "stop" and usable[-1] not in cut.message.content
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**dict(ask, max_completion_tokens=600))
    assert err.value.param == "max_completion_tokens" and err.value.code == "context_length_exceeded"


def test_a_field_we_would_ignore_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="chat", prompt="hi", max_tokens=4, echo=True)
    assert (err.value.param, err.value.code, err.value.type) == (
        "echo",
        "unsupported_parameter",
        "invalid_request_error",
    )
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert err.value.param == "top_logprobs"


def test_an_overloaded_engine_is_a_503_with_retry_after(client):
    """``code`` sheds what waits 1 ms for admission: of ten long requests at once, its cache (8 blocks
    of 128 tokens; 2 a sequence here) admits three, and the rest are shed as each ends."""
    from concurrent.futures import ThreadPoolExecutor

    def one(_):
        try:
            client.completions.create(model="code", prompt="tell me a story", max_tokens=300)
            return None
        except openai.APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, range(10)))
    shed = [e for e in results if e is not None]
    assert shed and len(shed) < 10, results
    for exc in shed:
        assert isinstance(exc, openai.InternalServerError) and exc.status_code == 503
        assert (exc.code, exc.type) == ("overloaded", "server_error") and "max_queue_wait_ms" in exc.message
        assert int(exc.response.headers["retry-after"]) >= 1
