"""Direct ingress on the real stack (``gpubroker.deployments.serve.direct_ingress``): Ray started with Serve's
direct ingress, a fleet with ``broker.direct_ingress: true``; each model replica answers its own
port on 127.0.0.1, with the same admission and validation as through the proxy, and the broker
counts what it answers. One Ray instance for the module (it needs its own environment)."""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request

import pytest

from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration

YAML = """
broker:
  name: gpubroker-direct
  namespace: gpubroker-direct
  control_interval_s: 0.5
  report_interval_s: 0.25
  metrics_port: 0
  http_host: 127.0.0.1
  http_port: {port}
  direct_ingress: true
gpu:
  device: cpu
  capacity: 1GiB
  reserve_frac: 0.0
models:
  mlp:
    model: mlp
    quota: {{min: 256MiB, base: 256MiB, max: 256MiB}}
    batch: {{floor: 2, ceiling: 16}}
    slo_p95_ms: 2000
    max_body_bytes: 16KiB
  prof:
    model: profiled
    options: {{a_ms: 5, c_ms: 0.2, weights_bytes: 0, bytes_per_item: 0}}
    quota: {{min: 128MiB, base: 256MiB, max: 512MiB}}
    batch: {{floor: 2, ceiling: 16}}
    slo_p95_ms: 2000
"""


def post(url: str, body: bytes, timeout_s: float = 30.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def direct_fleet():
    import ray

    from gpubroker.deployments.cluster.fleet import deploy, teardown, wait_serving
    from gpubroker.deployments.cluster.local_ray import free_port
    from gpubroker.deployments.serve.direct_ingress import DIRECT_ENV
    from gpubroker.quotas.config import parse_config_text

    port = free_port()
    text = YAML.format(port=port)
    cfg = parse_config_text(text)
    added = [k for k in DIRECT_ENV if k not in os.environ]
    os.environ.update({k: DIRECT_ENV[k] for k in added})  # Ray's processes inherit it
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        broker = deploy(cfg, text, http_port=port, timeout_s=300)
        url = f"http://127.0.0.1:{port}"
        wait_serving(cfg, url, timeout_s=180)
        yield url, broker
        teardown(cfg)
    finally:
        ray.shutdown()
        for k in added:
            os.environ.pop(k, None)


def model_urls(url: str) -> dict[str, list[str]]:
    box: dict[str, list[str]] = {}

    def listed() -> bool:
        box.update(get(url + "/v1/models").get("direct", {}))
        return bool(box) and all(box.values())

    wait_for(listed, timeout_s=60, what="every model's direct URL on /v1/models")
    return box


def test_each_model_answers_on_its_own_port_as_through_the_proxy(direct_fleet):
    url, broker = direct_fleet
    urls = model_urls(url)
    assert set(urls) == {"mlp", "prof"}
    for name, found in urls.items():
        assert len(found) == 1 and found[0].startswith("http://127.0.0.1:") and found[0].endswith(f"/{name}/infer")
        assert f":{int(url.rsplit(':', 1)[1])}/" not in found[0]  # not the proxy's port
    body = json.dumps({"inputs": [{"x": [0.1] * 64}, {"x": [-0.2] * 64}]}).encode()
    code_d, direct = post(urls["mlp"][0], body)
    code_p, proxied = post(f"{url}/v1/models/mlp/infer", body)
    assert code_d == code_p == 200
    assert direct["outputs"] == proxied["outputs"] and len(direct["outputs"]) == 2


def test_bad_input_and_oversize_bodies_are_refused_on_the_direct_port_too(direct_fleet):
    url, _ = direct_fleet
    target = model_urls(url)["mlp"][0]
    code, doc = post(target, json.dumps({"inputs": [{"x": [0.1] * 3}]}).encode())
    assert code == 422 and "x" in doc["field"]
    code, doc = post(target, json.dumps({"inputs": [{"x": [0.1] * 64}] * 400}).encode())
    assert code == 413 and "max_body_bytes" in doc["detail"]


def test_the_broker_counts_requests_answered_on_the_direct_port(direct_fleet):
    import ray

    url, broker = direct_fleet
    target = model_urls(url)["prof"][0]

    def done() -> int:
        return int(ray.get(broker.status.remote(), timeout=30)["models"]["prof"]["completions"] or 0)

    before = done()
    body = json.dumps({"inputs": [{}]}).encode()
    for _ in range(12):
        assert post(target, body)[0] == 200
    wait_for(lambda: done() >= before + 12, timeout_s=30, what="the broker's count of direct requests")


def test_the_direct_port_binds_only_loopback(direct_fleet):
    url, _ = direct_fleet
    port = int(model_urls(url)["prof"][0].split(":")[2].split("/")[0])
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:  # the address of the interface a packet out would take (a UDP connect sends nothing)
        probe.connect(("192.0.2.1", 9))
        other = probe.getsockname()[0]
    except OSError:
        pytest.skip("no network interface besides loopback")
    finally:
        probe.close()
    if other.startswith("127."):
        pytest.skip("no network interface besides loopback")
    with pytest.raises(OSError):
        socket.create_connection((other, port), timeout=3).close()
