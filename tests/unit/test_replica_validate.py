"""A 422 names every bad input of a request (``ModelReplica._validate_all``), not only the first, and a
single input's answer stays one error (``http_api.answer_for``)."""

from __future__ import annotations

from gpubroker.deployments.models import InputError
from gpubroker.deployments.replica.deployment import ModelReplica
from gpubroker.deployments.serve.http_api import answer_for


class FourNumbers:
    def validate(self, item):
        x = item.get("x") if isinstance(item, dict) else None
        if x == "boom":
            raise RuntimeError("validator bug")
        if not isinstance(x, list) or len(x) != 4:
            raise InputError("x", "expected a list of 4 numbers")
        return item

    def cost(self, item):
        return 1


def _replica() -> ModelReplica:
    replica = object.__new__(ModelReplica)  # the method reads only the adapter and the pricing
    replica.adapter = FourNumbers()
    replica.token_priced = False
    return replica


def test_every_bad_input_is_named_in_order():
    good = {"x": [1, 2, 3, 4]}
    out = _replica()._validate_all([good, {"x": [1]}, good, {"x": "boom"}, {"y": 0}])
    assert isinstance(out, dict) and out["status"] == 422
    assert [e["field"] for e in out["errors"]] == ["inputs[1].x", "inputs[3]", "inputs[4].x"]
    assert out["field"] == "inputs[1].x" and out["detail"].startswith("inputs[1].x: expected a list of 4 numbers")
    assert "2 more bad input(s)" in out["detail"]
    body = answer_for("m", out, single=False, retry_after_s=1).body
    assert body["errors"] == out["errors"] and body["field"] == "inputs[1].x"


def test_good_inputs_pass_and_one_bad_input_reads_as_before():
    items = _replica()._validate_all([{"x": [1, 2, 3, 4]}] * 3)
    assert isinstance(items, list) and len(items) == 3
    one = _replica()._validate_all([{"x": [1]}])
    assert one["detail"] == "inputs[0].x: expected a list of 4 numbers" and len(one["errors"]) == 1
    body = answer_for("m", one, single=True, retry_after_s=1).body
    assert body == {"detail": "input.x: expected a list of 4 numbers", "field": "input.x"}
