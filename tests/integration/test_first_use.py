"""First use on real Ray Serve (CPU): the first requests ``gpubroker up`` sends
(``gpubroker.deployments.cluster.fleet.wait_serving``, the function ``up_fleet`` calls) with user models written
from the README. ``strict`` has ``validate`` and no ``example_input``: it is not asked, it
serves. ``wrong``'s ``example_input`` is refused by its own ``validate``: the wait stops with
an error naming the model, the answer and the fix, not at its timeout.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration._fleet import local_fleet

pytestmark = pytest.mark.integration

CONFIG = """
broker: {name: gpubroker-first, namespace: gpubroker-first, control_interval_s: 0.5,
         report_interval_s: 0.25, metrics_port: 0, http_host: 127.0.0.1, http_port: 8000}
gpu: {device: cpu, capacity: 1GiB, reserve_frac: 0.0, emergency_free_frac: 0.05}
models:
  strict:
    model: tests.integration.user_models:StrictModel
    quota: {min: 64MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 1, ceiling: 8}
    slo_p95_ms: 2000
  wrong:
    model: tests.integration.user_models:WrongExampleModel
    quota: {min: 64MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 1, ceiling: 8}
    slo_p95_ms: 2000
"""
WAIT_TIMEOUT_S = 600.0  # far beyond what the refusal rule needs: the error must come from the rule


@pytest.fixture(scope="module")
def fleet():
    with local_fleet(CONFIG, wait=False) as (url, broker, cfg):
        yield cfg, url


def test_first_requests_skip_the_model_without_example_and_stop_on_the_refused_one(fleet):
    from gpubroker.deployments.cluster.fleet import FleetError, wait_serving

    cfg, url = fleet
    labels: list[str] = []
    with pytest.raises(FleetError) as err:
        wait_serving(cfg, url, timeout_s=WAIT_TIMEOUT_S, on_answer=lambda first: labels.append(first.label()))
    msg = str(err.value)
    assert "did not answer within" not in msg  # stopped by the refusal rule, not the timeout
    assert "model 'wrong'" in msg and "HTTP 422" in msg and "input.x" in msg, msg
    assert '{"input": {"x": "one"}}' in msg and "example_input()" in msg, msg
    assert any("strict skipped (no example_input" in lab for lab in labels), labels
    assert any("wrong 422" in lab for lab in labels), labels  # the progress showed the answer


def test_the_model_without_example_serves_and_validates(fleet):
    _, url = fleet
    r = httpx.post(f"{url}/v1/models/strict/infer", json={"inputs": [{"x": 1.5}, {"x": 2}]}, timeout=60)
    assert r.status_code == 200 and r.json()["outputs"] == [{"y": 3.0}, {"y": 4.0}], r.text
    r = httpx.post(f"{url}/v1/models/strict/infer", json={"input": {}}, timeout=60)
    assert r.status_code == 422 and r.json()["field"] == "input.x", r.text
