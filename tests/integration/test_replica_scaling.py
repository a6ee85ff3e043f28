"""A replica target reaches Serve without restarting the replica that stays (real Ray Serve, CPU).

One ``profiled`` model with 2 replicas under a ``throughput`` default profile. After its first
requests the model is idle: one replica carries no load, so the broker lowers its target to 1
after the hysteresis (2 x window_s); the fleet API's scaler (``gpubroker.deployments.serve.scaler``) sets the Serve
deployment to 1 replica through the external-scaler API, and the replica left is one of the two
that were running (same actor id, same pid). An ``apply`` of a ``latency`` profile raises the
target back to 2 at once: Serve starts one replica and the survivor keeps running. Requests are
answered before, between and after. One Ray instance for the module.
"""

from __future__ import annotations

import httpx
import pytest

from gpubroker.deployments.cluster.fleet import APP_NAME
from tests.integration._fleet import local_fleet
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration

CONFIG = """
broker: {name: gpubroker-scale, namespace: gpubroker-scale, control_interval_s: 0.5,
         report_interval_s: 0.25, metrics_port: 0, http_host: 127.0.0.1, http_port: 8000}
gpu: {device: cpu, capacity: 1GiB, reserve_frac: 0.0}
models:
  hot:
    model: profiled
    options: {a_ms: 5, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 1048576}
    quota: {min: 64MiB, base: 256MiB, max: 512MiB}
    batch: {floor: 1, ceiling: 16}
    slo_p95_ms: 1500
    replicas: 2
    control: {window_s: 2, idle_hold_s: 2, min_samples: 3}
profiles:
  schedule:
    - {name: peak, default: true, objective: throughput, price_per_gpu_hour: 3.0}
"""


@pytest.fixture(scope="module")
def fleet():
    with local_fleet(CONFIG) as (url, broker, cfg):
        yield url, broker


def running_replicas(deployment: str = "hot") -> dict[str, int]:
    """The deployment's RUNNING replicas as Serve's controller has them: actor id -> pid."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    dep = details["applications"][f"{APP_NAME}-hot"]["deployments"][deployment]
    return {r["actor_id"]: r["pid"] for r in dep["replicas"] if r["state"] == "RUNNING"}


def answers(url: str) -> bool:
    r = httpx.post(f"{url}/v1/models/hot/infer", json={"inputs": [{}, {}]}, timeout=60)
    return r.status_code == 200 and len(r.json()["outputs"]) == 2


def test_a_lower_and_a_raise_reach_serve_without_restarting_the_survivor(fleet):
    import ray

    url, broker = fleet
    before = wait_for(lambda: (lambda r: r if len(r) == 2 else None)(running_replicas()), 60, what="2 replicas")
    assert answers(url)

    # idle under throughput: the target drops to 1 and Serve follows, keeping one of the two
    wait_for(lambda: ray.get(broker.status.remote())["models"]["hot"]["replica_target"] == 1, 60, what="target 1")
    after = wait_for(lambda: (lambda r: r if len(r) == 1 else None)(running_replicas()), 60, what="1 replica")
    [(survivor, pid)] = after.items()
    assert survivor in before and before[survivor] == pid  # the same actor, the same process
    assert answers(url)
    scaler = httpx.get(f"{url}/v1/replicas", timeout=30).json()
    assert scaler["running"] and scaler["applied"] == {f"{APP_NAME}-hot/hot": 1} and scaler["errors"] == {}
    [lower] = [e for e in ray.get(broker.decisions.remote("hot")) if e["kind"] == "replicas"]
    assert lower["rule"] == "replicas_lower" and lower["new"] == {"replica_target": 1}

    # off-peak (a latency profile applied live): back to the configured 2 at once
    text = ray.get(broker.config_text.remote())
    res = ray.get(broker.apply.remote(text.replace("objective: throughput", "objective: latency")))
    assert res["ok"], res
    both = wait_for(lambda: (lambda r: r if len(r) == 2 else None)(running_replicas()), 90, what="2 replicas again")
    assert survivor in both and both[survivor] == pid
    assert answers(url)
    raised = [e for e in ray.get(broker.decisions.remote("hot")) if e["kind"] == "replicas"][-1]
    assert raised["rule"] == "replicas_configured" and raised["new"] == {"replica_target": 2}
