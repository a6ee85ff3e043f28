"""One hop without the proxy: each model replica answers HTTP on its own port.

Ray Serve 2.60 has *direct ingress* (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1`` in the environment
Ray starts with): every replica of an ingress deployment runs its own HTTP server on a port of
its node (30000-31000 by default), bound to the same host as Serve's proxy, and answers its
application's routes there. gpubroker's model apps are each their own ingress, so with it on a
client can send ``POST /v1/models/<name>/infer`` straight to a replica: no proxy process, no
replica-to-proxy callback for the body, no Ray actor call per request: less CPU per request on
the serving path (``python -m bench.cost_per_request --arms fleet,fleet-direct`` measures it;
docs/BENCHMARKS.md). Serve's proxy keeps working beside it, on its one port, for every route.

What it does not give: one address for all replicas (each replica has its own port; a client or
a load balancer in front picks one, and a replica that stops takes its port with it; Ray's own
answer is HAProxy in front, not set up here), and the proxy's JSON answer for a replica lost
with the request on it (``gpubroker.deployments.serve.http_proxy``): a direct client sees the connection drop
and retries on another URL or on the proxy.

``broker.direct_ingress: true`` asks for it. ``gpubroker up`` puts ``DIRECT_ENV`` in the
environment of the local Ray it starts; a cluster started by hand needs the same variables on
every node. The fleet API lists each model's replica URLs on ``GET /v1/models`` (read from
Serve's controller, off the request path), and ``up`` prints them.

Pure where it can be: ``model_urls`` turns Serve's target groups into the URLs; the one Ray call
is ``target_groups``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

DIRECT_ENV = {
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    # a replica that stops keeps its port open this long for load balancers to drop it (Ray's
    # default 30 s is for a cloud balancer; here clients hold the URLs, and redeploys wait on it)
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


def _binds_every_interface(bind_host: str) -> bool:
    try:
        return not bind_host or ipaddress.ip_address(bind_host).is_unspecified
    except ValueError:  # a name, such as localhost
        return False


def url_host(bind_host: str, node_ip: str) -> str:
    """The host a client uses for a replica's port: the bind host itself, or the node's IP when
    the servers bind every interface (the unspecified address of IPv4 or IPv6)."""
    host = node_ip if _binds_every_interface(bind_host) else bind_host
    return f"[{host}]" if ":" in host else host


def replica_ports(groups: Iterable[Any], app_of: Mapping[str, str], bind_host: str) -> dict[str, list[tuple[str, str]]]:
    """Each key's (``http://host:port``, route prefix) per replica of its Serve app (sorted),
    from Serve's target groups.

    ``groups``: ``TargetGroup``-like objects (``app_name``, ``protocol``, ``route_prefix``,
    ``ingress_deployment_name``, ``targets`` with ``ip`` and ``port``); groups that point at a
    proxy (no ingress deployment) are not direct and are left out, and so are gRPC ones.
    ``app_of``: key (a model) -> its Serve app. A key with no running replica yet (or direct
    ingress off) gets an empty list."""
    key_of = {app: key for key, app in app_of.items()}
    found: dict[str, set[tuple[str, str]]] = {key: set() for key in app_of}
    for g in groups:
        key = key_of.get(getattr(g, "app_name", ""))
        if key is None or not getattr(g, "ingress_deployment_name", ""):
            continue
        if str(getattr(g.protocol, "value", g.protocol)).upper() != "HTTP":
            continue
        prefix = g.route_prefix.rstrip("/")
        for t in g.targets:
            found[key].add((f"http://{url_host(bind_host, t.ip)}:{t.port}", prefix))
    return {key: sorted(v) for key, v in found.items()}


def model_urls(groups: Iterable[Any], app_of: Mapping[str, str], bind_host: str) -> dict[str, list[str]]:
    """Each model's replica URLs (its ``POST`` target, sorted) from Serve's target groups."""
    return _as_urls(replica_ports(groups, app_of, bind_host))


def _as_urls(ports: Mapping[str, list[tuple[str, str]]]) -> dict[str, list[str]]:
    # a model app's route prefix is ``.../v1/models/<name>``: its URL is the port, the prefix, /infer
    return {model: [f"{base}{prefix}/infer" for base, prefix in found] for model, found in ports.items()}


async def target_groups(timeout_s: float = 5.0) -> list[Any]:
    """Serve's target groups, from its controller (an awaited actor call: off the request path)."""
    import asyncio

    controller = await asyncio.to_thread(_controller)
    return await asyncio.wait_for(controller.get_target_groups.remote(), timeout=timeout_s)


def target_groups_sync(timeout_s: float = 10.0) -> list[Any]:
    """``target_groups`` for a driver (``gpubroker up``, the benchmarks)."""
    import ray

    return ray.get(_controller().get_target_groups.remote(), timeout=timeout_s)


def _controller() -> Any:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


def not_enabled_hint() -> str:
    env = " ".join(f"{k}={v}" for k, v in DIRECT_ENV.items())
    return (
        "broker.direct_ingress is set, but no model replica serves its own port: this Ray cluster was "
        f"started without direct ingress. Start every node with `{env} ray start ...` "
        "(gpubroker up does this for the local Ray it starts); until then models answer through the proxy."
    )


def wait_replica_ports(
    app_of: Mapping[str, str], bind_host: str, timeout_s: float = 20.0, poll_s: float = 0.5
) -> dict[str, list[tuple[str, str]]]:
    """``replica_ports`` once every key has a port, or what there is at ``timeout_s`` (a replica
    opens its port just after it starts; on a cluster without direct ingress none does)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        ports = replica_ports(target_groups_sync(), app_of, bind_host)
        if all(ports.values()) or time.monotonic() >= deadline:
            return ports
        time.sleep(poll_s)


def wait_model_urls(app_of: Mapping[str, str], bind_host: str, timeout_s: float = 20.0) -> dict[str, list[str]]:
    """``model_urls`` once every model has a URL, or what there is at ``timeout_s``."""
    return _as_urls(wait_replica_ports(app_of, bind_host, timeout_s))
