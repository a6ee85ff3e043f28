"""The model API's HTTP rules (deployments.http_api) without Serve: limits, shapes, answers."""

from __future__ import annotations

import json

from deployments.http_api import HttpAnswer, ParsedBody, answer_for, length_check, parse_body


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
