"""One local Ray and a deployed fleet for a test module: the set-up every fleet module shares."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def local_fleet(config_text: str, *, wait: bool = True) -> Iterator[tuple[str, Any, Any]]:
    """``(url, broker handle, config)`` of ``config_text`` deployed as ``gpubroker up`` does, on a
    local Ray of its own (2 CPUs); ``wait``: until every model answered its first request."""
    import ray

    from deployments.fleet import deploy, teardown, wait_serving
    from deployments.local_ray import free_port
    from quotas.config import parse_config_text

    cfg = parse_config_text(config_text)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port()
        broker = deploy(cfg, config_text, http_port=port, timeout_s=300)
        url = f"http://127.0.0.1:{port}"
        if wait:
            wait_serving(cfg, url, timeout_s=180)
        yield url, broker, cfg
        teardown(cfg, name=cfg.broker.name, namespace=cfg.broker.namespace)
    finally:
        ray.shutdown()
