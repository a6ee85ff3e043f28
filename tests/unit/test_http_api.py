"""The model API's HTTP rules (gpubroker.deployments.serve.http_api) without Serve: limits, shapes, answers."""

from __future__ import annotations

import json

from gpubroker.deployments.serve.http_api import (
    HttpAnswer,
    ParsedBody,
    answer_for,
    length_check,
    llm_on_batch_route,
    parse_body,
)


def test_content_length_over_the_limit_is_413_before_reading():
    assert length_check("mlp", "9000", 8192).status == 413
    assert "max_body_bytes (8192 bytes)" in length_check("mlp", "9000", 8192).body["detail"]
    assert length_check("mlp", "100", 8192) is None
    assert length_check("mlp", None, 8192) is None
    assert length_check("mlp", "ten", 8192).status == 400


def test_body_shapes_name_the_field():
    cases = {
        b"{oops": "body",
        b"[1, 2]": "body",
        b'{"inputs": [], "x": 1}': "x",
        b'{"inputs": [1], "input": 1}': "inputs",
        b'{"inputs": []}': "inputs",
        b'{"inputs": {}}': "inputs",
        b"{}": "inputs",
    }
    for body, fld in cases.items():
        out = parse_body(body)
        assert isinstance(out, HttpAnswer) and out.status == 422 and out.body["field"] == fld, (body, out)
        assert out.body["detail"].startswith(fld + ":")
    assert parse_body(b'{"input": {"x": 1}}') == ParsedBody([{"x": 1}], True)
    assert parse_body(b'{"inputs": [1, 2]}') == ParsedBody([1, 2], False)


def test_answers_follow_the_replica_result():
    ok = answer_for("m", {"status": 200, "outputs": [7], "latency_ms": 1.5}, single=True, retry_after_s=1)
    assert ok.status == 200 and ok.body == {"model": "m", "output": 7, "latency_ms": 1.5}
    many = answer_for("m", {"status": 200, "outputs": [7, 8], "latency_ms": 2.0}, single=False, retry_after_s=1)
    assert many.body["outputs"] == [7, 8]
    bad = answer_for("m", {"status": 422, "detail": "inputs[0].x: too short", "field": "inputs[0].x"}, True, 1)
    assert bad.status == 422 and bad.body == {"detail": "input.x: too short", "field": "input.x"}
    full = answer_for("m", {"status": 503, "detail": "queue is full; retry later", "retry_after_s": 3}, False, 1)
    assert full.status == 503 and full.headers == {"Retry-After": "3"} and "retry_after_s" not in full.body
    assert answer_for("m", {"status": 503, "detail": "paused"}, False, 2).headers == {"Retry-After": "2"}
    assert answer_for("m", {"status": 504, "detail": "late"}, False, 2).headers == {}
    assert json.loads(ok.encoded()) == ok.body


# ---------------------------------------------------------------------------------------------
# Outputs as ordinary PyTorch code returns them (numpy, torch, tuples, dataclasses), and NaN.


def test_numpy_torch_tuples_and_dataclasses_become_json():
    import dataclasses
    import enum

    import numpy as np
    import torch

    class Kind(enum.Enum):
        CAT = "cat"

    @dataclasses.dataclass
    class Scored:
        label: np.int64
        score: np.float32
        kind: Kind

    outputs = [
        {"score": np.float32(0.5), "vec": np.arange(3, dtype=np.float64), "label": np.int64(7)},
        (torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor(3)),
        Scored(np.int64(2), np.float32(0.25), Kind.CAT),
        np.bool_(True),
    ]
    answer = answer_for("m", {"status": 200, "outputs": outputs, "latency_ms": 1.0}, False, 1)
    assert answer.status == 200, answer.body
    assert json.loads(answer.encoded())["outputs"] == [
        {"score": 0.5, "vec": [0.0, 1.0, 2.0], "label": 7},
        [[1.0, 2.0], 3],
        {"label": 2, "score": 0.25, "kind": "cat"},
        True,
    ]


def test_plain_outputs_pass_unchanged():
    outputs = [{"y": [1.0, 2.0]}, 3, "s", None]
    answer = answer_for("m", {"status": 200, "outputs": outputs}, False, 1)
    assert answer.status == 200 and answer.body["outputs"] is not None
    assert json.loads(answer.encoded())["outputs"] == outputs


def test_nan_or_infinity_is_a_json_500_naming_the_item_and_the_field():
    import numpy as np

    outputs = [{"score": 1.0}, {"scores": [0.0, float("nan")]}]
    answer = answer_for("scorer", {"status": 200, "outputs": outputs}, False, 1)
    assert answer.status == 500
    assert answer.body["field"] == "outputs[1].scores[1]", answer.body
    assert "model 'scorer'" in answer.body["detail"] and "nan" in answer.body["detail"]
    json.loads(answer.encoded())  # the refusal itself is JSON

    single = answer_for("scorer", {"status": 200, "outputs": [{"score": np.float32("inf")}]}, True, 1)
    assert single.status == 500 and single.body["field"] == "output.score", single.body
    assert "inf" in single.body["detail"]


def test_an_output_of_no_json_shape_is_a_500_naming_it():
    class Opaque:
        pass

    answer = answer_for("m", {"status": 200, "outputs": [{"x": Opaque()}]}, False, 1)
    assert answer.status == 500 and answer.body["field"] == "outputs[0].x"
    assert "Opaque is not JSON" in answer.body["detail"], answer.body


def test_an_llm_on_the_batch_route_is_a_400_naming_the_openai_route():
    out = llm_on_batch_route("tiny")
    assert out.status == 400 and out.body["field"] == "model"
    assert "/openai/v1/completions" in out.body["detail"] and '"model": "tiny"' in out.body["detail"]


def test_an_llms_first_request_is_one_token_on_the_openai_route():
    from gpubroker.deployments.cluster.fleet import first_request
    from gpubroker.quotas.config import parse_config_text

    cfg = parse_config_text(
        """
gpu: {device: cpu, capacity: 4GiB, reserve_frac: 0.0}
models:
  mlp: {model: mlp, quota: {min: 64MiB, base: 128MiB, max: 256MiB}}
  tiny: {kind: llm, model: tiny-llama, quota: {min: 256MiB, base: 512MiB, max: 1GiB}}
"""
    )
    assert first_request(cfg, "mlp", [1.0]) == ("/v1/models/mlp/infer", {"input": [1.0]})
    path, body = first_request(cfg, "tiny", "Hello")
    assert path == "/openai/v1/completions" and body == {"model": "tiny", "prompt": "Hello", "max_tokens": 1}
