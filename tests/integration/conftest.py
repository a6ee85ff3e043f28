"""One Ray instance and one live fleet per test module (the machine has 2 cores)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.harness import wait_for  # noqa: F401 - shared polling helper, re-exported for the tests here

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).parent
FLEET_YAML = HERE / "fleet.yaml"


@dataclass
class Fleet:
    url: str
    cfg: Any
    text: str
    broker: Any

    def status(self) -> dict:
        import ray

        return ray.get(self.broker.status.remote(), timeout=30)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    import ray

    from gpubroker.deployments.cluster.fleet import deploy, teardown, wait_serving
    from gpubroker.deployments.cluster.local_ray import free_port
    from gpubroker.quotas.config import parse_config_text

    text = FLEET_YAML.read_text()
    ckpt = tmp_path_factory.mktemp("broker") / "checkpoint.json"
    text = text.replace("  http_port: 8000", f"  http_port: 8000\n  checkpoint_path: {ckpt}")
    cfg = parse_config_text(text)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port()
        broker = deploy(cfg, text, http_port=port, timeout_s=300)
        url = f"http://127.0.0.1:{port}"
        wait_serving(cfg, url, timeout_s=180)
        yield Fleet(url, cfg, text, broker)
        teardown(cfg)
    finally:
        ray.shutdown()
