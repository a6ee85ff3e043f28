"""The OpenAI surface as plain functions: request bodies (completions, chat, embeddings), OpenAI's
error shape, response bodies from token pieces, and which models embed. No Serve, no engine:
``tests/integration/test_llm_api.py`` and ``test_fleet.py`` drive the same code with the real
``openai`` client."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from gpubroker.deployments.llm.engine import FinishReason, TokenDelta, TokenLogprob
from gpubroker.deployments.llm.openai_bodies import Choice, chunk_choice, whole_choices
from gpubroker.deployments.models import ModelAdapter, resolve_model
from gpubroker.deployments.serve.embeddings import EmbeddingsRequest, parse_embeddings, replica_error
from gpubroker.deployments.serve.openai_errors import ErrorType, OpenAIError
from gpubroker.quotas.config import parse_config_text

CHAT_MSG = [{"role": "user", "content": "hi"}]


def parse(raw: dict):
    pytest.importorskip("fastapi")
    from gpubroker.deployments.llm.openai_api import parse_body

    body, err = parse_body("chat" if "messages" in raw else "completion", raw)
    return body, (None if err is None else (err.status_code, json.loads(err.body)["error"]))


def test_completion_params_map_to_the_engines_names():
    body, err = parse(
        {"model": "m", "prompt": "hi", "n": 3, "seed": 7, "logprobs": 2, "stream": True,
         "stream_options": {"include_usage": True}, "stop": "x", "user": "u1", "echo": None}
    )  # fmt: skip
    assert err is None
    assert (body["n"], body["seed"], body["logprobs"], body["include_usage"], body["stop"]) == (3, 7, 2, True, "x")
    assert body["max_tokens"] == 16 and "user" not in body and "echo" not in body  # null is "not sent"


def test_chat_logprobs_and_max_completion_tokens():
    body, err = parse(
        {"model": "m", "messages": CHAT_MSG, "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 9}
    )
    assert err is None and body["logprobs"] == 3 and body["max_tokens"] == 9
    assert body["max_tokens_param"] == "max_completion_tokens"
    body, _ = parse({"model": "m", "messages": CHAT_MSG, "logprobs": True})
    assert body["logprobs"] == 0  # the tokens' own logprobs, no alternatives
    body, _ = parse({"model": "m", "messages": CHAT_MSG})
    assert body["logprobs"] is None and body["max_tokens"] == 64


@pytest.mark.parametrize(
    "raw, param, code",
    [
        ({"model": "m", "prompt": "hi", "logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
        ({"model": "m", "prompt": "hi", "echo": True}, "echo", "unsupported_parameter"),
        ({"model": "m", "messages": CHAT_MSG, "tools": []}, "tools", "unsupported_parameter"),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "name": "b"}]}, "messages.0.name",
         "unsupported_parameter"),
        ({"model": "m", "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"model": "m", "messages": CHAT_MSG, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"model": "m", "prompt": "hi", "logprobs": 6}, "logprobs", "invalid_value"),
        ({"model": "m", "prompt": "hi", "n": 0}, "n", "invalid_value"),
        ({"model": "m", "prompt": "hi", "seed": "x"}, "seed", "invalid_value"),
        ({"prompt": "hi"}, "model", "missing_required_parameter"),
    ],
)  # fmt: skip
def test_a_bad_or_unsupported_field_is_a_400_naming_it(raw, param, code):
    _, err = parse(raw)
    assert err is not None and err[0] == 400
    assert err[1]["param"] == param and err[1]["code"] == code and err[1]["type"] == "invalid_request_error"
    assert param.split(".")[-1] in err[1]["message"]


def test_the_unsupported_message_lists_what_is_supported():
    _, err = parse({"model": "m", "prompt": "hi", "best_of": 2})
    assert "Supported:" in err[1]["message"] and "seed" in err[1]["message"] and "logprobs" in err[1]["message"]


def test_openai_error_carries_retry_after_only_when_set():
    err = OpenAIError(503, "busy", ErrorType.SERVER, None, "overloaded", 2)
    assert err.reply() == {
        "status": 503,
        "body": {"error": {"message": "busy", "type": "server_error", "param": None, "code": "overloaded"}},
        "headers": {"Retry-After": "2"},
    }
    assert OpenAIError(400, "x", ErrorType.INVALID_REQUEST).headers() == {}


LP = (TokenLogprob(5, "ab", -0.5, (("ab", -0.5), ("c", -1.0))), TokenLogprob(6, "d", -2.0, (("e", -0.2),)))


def test_whole_choices_in_both_shapes():
    c = Choice()
    c.add(TokenDelta((5,), text="ab", logprobs=LP[:1]))
    c.add(TokenDelta((6,), True, FinishReason.STOP, text="d", logprobs=LP[1:]))
    (comp,) = whole_choices("completion", [c], True)
    assert comp["text"] == "abd" and comp["finish_reason"] == "stop"
    assert comp["logprobs"] == {
        "tokens": ["ab", "d"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"ab": -0.5, "c": -1.0}, {"e": -0.2}],
        "text_offset": [0, 2],
    }
    (chat,) = whole_choices("chat", [c], True)
    assert chat["message"] == {"role": "assistant", "content": "abd"}
    first = chat["logprobs"]["content"][0]
    assert first["token"] == "ab" and first["bytes"] == [97, 98] and len(first["top_logprobs"]) == 2
    assert (
        whole_choices("chat", [c, c], False)[1]["index"] == 1
        and whole_choices("chat", [c], False)[0]["logprobs"] is None
    )


def test_a_stream_chunk_offsets_its_text_and_skips_empty_pieces():
    chunk = chunk_choice("completion", 2, TokenDelta((6,), text="d", logprobs=LP[1:]), True, offset=7)
    assert chunk["index"] == 2 and chunk["logprobs"]["text_offset"] == [7]
    assert chunk_choice("chat", 0, TokenDelta(()), False, 0) is None
    end = chunk_choice("chat", 1, TokenDelta((), True, FinishReason.LENGTH), False, 0)
    assert end == {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "length"}


FLEET = parse_config_text(
    """
gpu: {device: cpu, capacity: 4GiB}
models:
  minilm: {model: minilm, quota: {min: 1GiB, base: 1GiB, max: 1GiB}}
  chat: {kind: llm, model: tiny-llama, quota: {min: 4MiB, base: 12MiB, max: 24MiB}}
"""
)


def embeddings(doc) -> EmbeddingsRequest | OpenAIError:
    return parse_embeddings(json.dumps(doc).encode(), FLEET)


def test_embeddings_bodies():
    req = embeddings({"model": "minilm", "input": "hello"})
    assert isinstance(req, EmbeddingsRequest) and req.texts == ["hello"] and req.single
    req = embeddings({"model": "minilm", "input": ["a", "b"], "encoding_format": "base64"})
    assert req.texts == ["a", "b"] and not req.single and req.encoding_format == "base64"
    for doc, status, param, code in (
        ({"model": "nope", "input": "x"}, 404, "model", "model_not_found"),
        ({"model": "chat", "input": "x"}, 400, "model", "model_not_embedding"),
        ({"model": "minilm", "input": "x", "encoding_format": "int8"}, 400, "encoding_format", "invalid_value"),
        ({"model": "minilm", "input": "x", "dimensions": 8}, 400, "dimensions", "unsupported_parameter"),
        ({"model": "minilm", "input": ["a", ""]}, 400, "input[1]", "invalid_value"),
        ({"model": "minilm", "input": []}, 400, "input", "invalid_value"),
        ({"model": "minilm"}, 400, "input", "missing_required_parameter"),
    ):
        err = embeddings(doc)
        assert isinstance(err, OpenAIError), doc
        assert (err.status, err.param, err.code) == (status, param, code), doc


def test_base64_is_float32_little_endian():
    from gpubroker.deployments.serve.embeddings import embeddings_body

    req = EmbeddingsRequest("minilm", ["a"], "base64", True)
    body = embeddings_body(req, [[0.5, -1.25]], 3)
    packed = base64.b64decode(body["data"][0]["embedding"])
    assert struct.unpack("<2f", packed) == (0.5, -1.25)
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3} and body["data"][0]["index"] == 0


def test_a_replicas_refusal_in_openais_shape():
    req = EmbeddingsRequest("minilm", ["a", "b", "c"], "float", False)
    bad = {"status": 422, "field": "inputs[2].text", "detail": "inputs[2].text: text has 600 tokens"}
    err = replica_error(req, bad)
    assert (err.status, err.param, err.code) == (422, "input[2]", "invalid_input") and "input[2]:" in err.message
    busy = replica_error(req, {"status": 503, "detail": "queue is full", "retry_after_s": 3})
    assert (busy.status, busy.code, busy.headers()) == (503, "overloaded", {"Retry-After": "3"})
    assert replica_error(req, {"status": 413, "detail": "over"}).code == "body_too_large"
    assert replica_error(req, {"status": 400, "field": "model", "detail": "x"}).code == "model_not_embedding"


class Duck:
    def predict(self, items):
        return [[1.0, 2.0] for _ in items]

    def embedding_input(self, text):
        return {"t": text}


class Plain:
    def predict(self, items):
        return items


def test_a_model_embeds_when_it_has_embedding_input():
    duck = resolve_model("tests.unit.test_openai_shape:Duck")()
    assert duck.embeds() and duck.embedding_input("x") == {"t": "x"} and duck.embedding([1, 2]) == [1.0, 2.0]
    assert not resolve_model("tests.unit.test_openai_shape:Plain")().embeds()
    assert not ModelAdapter().embeds()
    assert ModelAdapter().embedding({"embedding": [3, 4]}) == [3.0, 4.0]
    with pytest.raises(ValueError, match="define embedding"):
        ModelAdapter().embedding({"logits": [1]})


def test_minilm_declares_it_embeds():
    pytest.importorskip("transformers")
    from gpubroker.deployments.models.minilm import MiniLmAdapter

    m = MiniLmAdapter()
    assert m.embeds() and m.embedding_input("hi") == {"text": "hi"}
    assert m.embedding({"embedding": [0.25]}) == [0.25]
