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

    from gpubroker.deployments.cluster.fleet import deploy, teardown, wait_serving
    from gpubroker.deployments.cluster.local_ray import free_port
    from gpubroker.quotas.config import parse_config_text

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


def replica_status(app: str, model: str) -> dict:
    """One replica's ``local_status`` (its pid, memory limit, settings) through its Serve handle."""
    from ray import serve

    from gpubroker.deployments.app import model_app_name

    return (
        serve.get_deployment_handle(model, app_name=model_app_name(model, app))
        .local_status.remote()
        .result(timeout_s=60)
    )


async def burst(url: str, model: str, bodies: list[tuple[str, dict]]) -> list[tuple[str, int, dict]]:
    """Every request to ``model`` at once; (kind, status, body) each."""
    import asyncio

    import httpx

    async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=128)) as client:

        async def one(kind: str, body: dict):
            r = await client.post(f"{url}/v1/models/{model}/infer", json=body)
            return kind, r.status_code, r.json()

        return await asyncio.gather(*(one(k, b) for k, b in bodies))
