"""``gpubroker up``'s first requests (gpubroker.deployments.cluster.first_requests) without HTTP: skip a model
without example_input, keep asking while a model starts, stop on one that keeps refusing."""

from __future__ import annotations

from gpubroker.deployments.cluster.first_requests import (
    REFUSALS_TO_STOP,
    REFUSING_S,
    FirstRequests,
    FirstState,
    example_of,
)
from gpubroker.deployments.models import InputError, resolve_model


class StrictNoExample:
    def predict(self, items):
        return items

    def validate(self, item):
        if "x" not in item:
            raise InputError("x", "required")
        return item


class WrongExample(StrictNoExample):
    def example_input(self, cost=None):
        return {"y": 1}


def test_a_model_without_example_input_is_skipped_and_says_why():
    has, value, why = example_of(resolve_model("tests.unit.test_first_requests:StrictNoExample")())
    assert not has and value is None and "first real request calibrates" in why
    first = FirstRequests.for_examples({"user": (has, value, why), "mlp": (True, {"x": [0.0]}, "")})
    assert first.asking() == ["mlp"] and first.settled() == 1
    assert "user skipped (no example_input" in first.label()


def test_starting_answers_keep_asking_and_a_200_is_up():
    first = FirstRequests.for_examples({"m": (True, {}, "")})
    for t, code in enumerate((0, 503, 503, 504, 429)):
        assert first.record("m", code, "starting", float(t * 10)) is FirstState.ASKING
    assert first.refused() is None and "m 503" not in first.label() and "m 429 starting" in first.label()
    assert first.record("m", 200, "{}", 60.0) is FirstState.UP and first.asking() == [] and first.settled() == 1


def test_a_model_that_keeps_refusing_stops_with_the_answer_and_the_fix():
    has, value, why = example_of(resolve_model("tests.unit.test_first_requests:WrongExample")())
    assert has and value == {"y": 1}
    first = FirstRequests.for_examples({"user": (has, value, why)})
    answer = '{"detail": "input.x: required", "field": "input.x"}'
    t = 0.0
    for _ in range(REFUSALS_TO_STOP - 1):
        assert first.record("user", 422, answer, t) is FirstState.ASKING
        t += REFUSING_S
    assert first.refused() is None
    assert first.record("user", 422, answer, t) is FirstState.REFUSED
    msg = first.refused()
    assert "model 'user'" in msg and "HTTP 422" in msg and "input.x: required" in msg
    assert '{"input": {"y": 1}}' in msg and "example_input()" in msg and "Fix:" in msg
    assert "user 422" in first.label()


def test_a_503_between_refusals_restarts_the_count():
    first = FirstRequests.for_examples({"m": (True, {}, "")})
    first.record("m", 422, "no", 0.0)
    first.record("m", 422, "no", 10.0)
    first.record("m", 503, "restarting", 20.0)
    first.record("m", 422, "no", 30.0)
    assert first.record("m", 422, "no", 40.0) is FirstState.ASKING  # 2 in a row, not 3


def test_a_model_without_a_200_for_wait_s_stops_with_its_last_answer_and_what_to_do():
    from gpubroker.deployments.cluster.first_requests import WAIT_S

    first = FirstRequests.for_examples({"lifter": (True, {}, ""), "ok": (True, {}, "")}, wait_s=WAIT_S)
    first.record("ok", 200, "{}", 0.0)
    emergency = '{"detail": "model \'lifter\' paused admission (memory emergency); retry later"}'
    t = 0.0
    while t < WAIT_S:
        assert first.record("lifter", 503, emergency, t) is FirstState.ASKING
        assert first.refused() is None
        t += 10.0
    assert first.record("lifter", 503, emergency, t) is FirstState.STUCK
    msg = first.refused()
    assert "model 'lifter'" in msg and "HTTP 503" in msg and "memory emergency" in msg, msg
    assert "models.lifter.quota" in msg and "--wait SECONDS" in msg, msg


def test_wait_s_sets_the_bound_and_no_answer_says_so():
    first = FirstRequests.for_examples({"m": (True, {}, "")}, wait_s=5.0)
    assert first.record("m", 0, "ConnectError()", 100.0) is FirstState.ASKING
    assert first.record("m", 0, "ConnectError()", 104.0) is FirstState.ASKING
    assert first.record("m", 0, "ConnectError()", 105.0) is FirstState.STUCK
    msg = first.refused()
    assert "in 5s" in msg and "no answer" in msg and "ray status" in msg, msg
