"""A user's own Ray Serve app under the broker (``gpubroker.managed``), on real Ray Serve over real
HTTP: a FastAPI ingress calls two managed deployments of one class (``tests/integration/
managed_app.py``) through ``DeploymentHandle``s. The deployments start the broker from their fleet
config themselves (no ``gpubroker up``). Concurrent clients load ``busy`` while ``idle`` gets a
trickle; ``busy``'s base quota leaves it a backlog that would miss its SLO, so the broker lends ``idle``'s quota to ``busy`` and raises ``busy``'s batch cap above the
largest batch its base quota holds. Asserted from the broker (its decision log and status) and
from the replica (its ``@serve.batch`` method's live ``max_batch_size``). One Ray for the module.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.integration.managed_app import build

pytestmark = pytest.mark.integration

MiB = 1024**2
CONFIG = """
broker: {{name: gpubroker-managed, namespace: gpubroker-managed, control_interval_s: 0.5,
         report_interval_s: 0.25, metrics_port: 0, batch_formation: eager, checkpoint_path: "{ckpt}"}}
gpu: {{device: cpu, capacity: 512MiB, reserve_frac: 0.0, emergency_free_frac: 0.01}}
models:
  busy:
    model: tests.integration.managed_app:Scorer
    quota: {{min: 64MiB, base: 256MiB, max: 448MiB}}
    batch: {{floor: 2, ceiling: 64, initial: 4}}
    wait: {{min_ms: 0, max_ms: 300, initial_ms: 5}}
    profile: {{a_ms: 100, c_ms: 2, weights_bytes: 32MiB, bytes_per_item: 16MiB}}
    slo_p95_ms: 300  # its base (a batch of 12) leaves a backlog that would miss this: it borrows
    control: {{idle_hold_s: 1, window_s: 10}}
  idle:
    model: tests.integration.managed_app:Scorer
    quota: {{min: 64MiB, base: 256MiB, max: 448MiB}}
    batch: {{floor: 2, ceiling: 64, initial: 4}}
    wait: {{min_ms: 0, max_ms: 300, initial_ms: 5}}
    profile: {{a_ms: 100, c_ms: 2, weights_bytes: 32MiB, bytes_per_item: 16MiB}}
    slo_p95_ms: 3000
    control: {{idle_hold_s: 1, window_s: 10}}
"""
BASE_CAP = int((256 * 0.9 - 32) // 16)  # the largest batch busy's base quota holds (memory_model.HEADROOM_FRAC 0.9)
CLIENTS = 32
MIN_REQUESTS = 400  # answered before the load stops
LOAD_LIMIT_S = 45.0


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    import ray
    from ray import serve

    from gpubroker.broker.actor import get_broker
    from gpubroker.deployments.cluster.local_ray import free_port

    ckpt = tmp_path_factory.mktemp("managed") / "checkpoint.json"
    text = CONFIG.format(ckpt=ckpt)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(text), name="user-app", route_prefix="/")
        yield f"http://127.0.0.1:{port}", get_broker("gpubroker-managed", "gpubroker-managed")
        serve.shutdown()
    finally:
        ray.shutdown()


def _load(url: str, client: int, stop: threading.Event, answers: list[tuple[str, int, float]]) -> None:
    with httpx.Client(timeout=60) as http:
        i = 0
        while not stop.is_set():
            i += 1
            name = "idle" if client == 0 and i % 10 == 0 else "busy"  # a trickle: idle stays idle, and answers
            try:
                r = http.post(f"{url}/score/{name}", json={"x": i})
                answers.append((name, r.status_code, float(r.json()["y"]) / i if r.status_code == 200 else 0.0))
            except httpx.HTTPError:
                answers.append((name, 0, 0.0))


def _moved(broker) -> tuple[bool, dict]:
    import ray

    models = ray.get(broker.status.remote(), timeout=30)["models"]
    busy, idle = models["busy"], models["idle"]
    moved = busy["grant_bytes"] > busy["base_bytes"] > idle["grant_bytes"] and busy["max_batch_size"] > BASE_CAP
    return moved, models


def test_the_broker_moves_a_grant_between_two_managed_deployments(app):
    import ray

    url, broker = app
    with httpx.Client(timeout=60) as http:
        first = http.post(f"{url}/score/busy", json={"x": 3}).json()
        assert first == {"y": 6.0}  # busy's user_config (factor 2) reached its reconfigure
        before = http.get(f"{url}/managed/busy").json()
    assert before["managed"] and before["batch_methods"]["score"]["max_batch_size"] <= BASE_CAP
    stop, answers = threading.Event(), []
    clients = [threading.Thread(target=_load, args=(url, c, stop, answers)) for c in range(CLIENTS)]
    for c in clients:
        c.start()
    start, moved, models = time.monotonic(), False, {}
    try:
        while (not moved or len(answers) < MIN_REQUESTS) and time.monotonic() - start < LOAD_LIMIT_S:
            time.sleep(1.0)
            moved, models = _moved(broker)
        with httpx.Client(timeout=60) as http:
            live = http.get(f"{url}/managed/busy").json()
    finally:
        stop.set()
        for c in clients:
            c.join()
    busy, idle = models["busy"], models["idle"]
    assert moved, f"no grant moved in {LOAD_LIMIT_S:.0f}s of load: busy {busy}, idle {idle}"
    assert len(answers) >= MIN_REQUESTS and all(status == 200 for _, status, _ in answers), answers[-5:]
    # each answer is its own input times its deployment's user_config factor (busy 2, idle 1)
    assert {name: {round(r, 6) for n, _, r in answers if n == name} for name in ("busy", "idle")} == {
        "busy": {2.0},
        "idle": {1.0},
    }
    assert busy["calibrated"] and busy["replicas"] == 1 and busy["completions"] > 0
    # The broker lent idle's quota to busy: its decision log has the move, from idle to busy.
    moves = [d for d in ray.get(broker.decisions.remote(), timeout=30) if d.get("kind") == "move"]
    assert any(d.get("donor") == "idle" and d.get("recipient") == "busy" for d in moves), moves[-5:]
    # The replica runs what the broker decided: its @serve.batch method's live cap is the broker's
    # (or a later one), above the base-fitting cap, and its memory limit follows the larger grant.
    score = live["batch_methods"]["score"]
    assert score["max_batch_size"] == live["settings"]["max_batch_size"] > BASE_CAP
    assert live["settings"]["grant_bytes"] > 256 * MiB
    assert score["batch_wait_timeout_s"] == live["settings"]["batch_wait_timeout_s"]
    assert live["memory_limit"] is not None
