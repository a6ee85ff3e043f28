"""Direct ingress (``gpubroker.deployments.serve.direct_ingress``): Serve's target groups -> each model's replica
URLs, the config switch and the environment ``gpubroker up`` gives the local Ray. Pure: the
target groups are plain objects shaped as Serve 2.60's ``TargetGroup`` (fakes of Serve's
controller answer; ``tests/integration/test_direct_ingress.py`` runs the real one)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gpubroker.deployments.serve.direct_ingress import DIRECT_ENV, model_urls, not_enabled_hint, replica_ports, url_host
from gpubroker.quotas.config import ConfigError, parse_config


@dataclass(frozen=True)
class T:
    ip: str
    port: int


@dataclass(frozen=True)
class G:
    app_name: str
    route_prefix: str
    targets: list[T]
    protocol: str = "HTTP"
    ingress_deployment_name: str = "m"
    extra: list[T] = field(default_factory=list)


APPS = {"a": "fleet-a", "b": "fleet-b"}


def test_each_model_gets_its_replicas_urls_sorted_on_the_bind_host():
    groups = [
        G("fleet-a", "/v1/models/a", [T("10.0.0.5", 30002), T("10.0.0.5", 30001)]),
        G("fleet-b", "/v1/models/b/", [T("10.0.0.5", 30003)]),
    ]
    urls = model_urls(groups, APPS, "127.0.0.1")
    assert urls == {
        "a": ["http://127.0.0.1:30001/v1/models/a/infer", "http://127.0.0.1:30002/v1/models/a/infer"],
        "b": ["http://127.0.0.1:30003/v1/models/b/infer"],
    }


def test_a_wildcard_bind_gives_each_replica_its_nodes_ip():
    groups = [G("fleet-a", "/x/v1/models/a", [T("10.0.0.5", 30001), T("10.0.0.6", 30001)])]
    assert model_urls(groups, APPS, "0.0.0.0")["a"] == [
        "http://10.0.0.5:30001/x/v1/models/a/infer",
        "http://10.0.0.6:30001/x/v1/models/a/infer",
    ]
    assert url_host("::", "fe80::1") == "[fe80::1]"
    assert url_host("localhost", "10.0.0.5") == "localhost"


def test_replica_ports_give_each_apps_bases_with_its_route_prefix():
    groups = [G("plain", "/plain/", [T("10.0.0.5", 30007)]), G("fleet-a", "/v1/models/a", [T("10.0.0.5", 30001)])]
    assert replica_ports(groups, {"p": "plain"}, "127.0.0.1") == {"p": [("http://127.0.0.1:30007", "/plain")]}


def test_proxy_groups_grpc_groups_and_other_apps_are_not_model_urls():
    groups = [
        G("fleet-a", "/v1/models/a", [T("10.0.0.5", 8000)], ingress_deployment_name=""),  # the proxy's
        G("fleet-a", "/v1/models/a", [T("10.0.0.5", 40001)], protocol="gRPC"),
        G("fleet", "/", [T("10.0.0.5", 30009)]),  # the fleet API: not a model
    ]
    assert model_urls(groups, APPS, "127.0.0.1") == {"a": [], "b": []}


def test_the_switch_is_off_by_default_and_validated():
    base = {
        "gpu": {"device": "cpu", "capacity": "1GiB"},
        "models": {"m": {"model": "mlp", "quota": {"min": "32MiB", "base": "64MiB", "max": "128MiB"}}},
    }
    assert parse_config(base, "t").broker.direct_ingress is False
    assert parse_config({**base, "broker": {"direct_ingress": True}}, "t").broker.direct_ingress is True
    with pytest.raises(ConfigError, match="direct_ingress"):
        parse_config({**base, "broker": {"direct_ingress": "sometimes"}}, "t")


def test_the_local_ray_environment_and_the_hint_name_the_variable():
    assert DIRECT_ENV["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert float(DIRECT_ENV["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) < 30  # Ray's default is 30 s
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS=1" in not_enabled_hint()


def test_start_local_ray_passes_the_variables_only_when_asked(monkeypatch):
    import subprocess

    from gpubroker.deployments.cluster import local_ray

    seen: list[dict[str, str]] = []

    class Done:
        returncode = 1
        stderr = "stop here"

    def fake_run(cmd, **kw):  # noqa: ANN001, ANN003 - subprocess.run's shape; no Ray is started
        seen.append(kw["env"])
        return Done()

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    for direct in (False, True):
        with pytest.raises(local_ray.FleetError):
            local_ray.start_local_ray(direct_ingress=direct)
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in seen[0]
    assert seen[1]["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"


def test_turning_it_on_by_apply_says_it_takes_the_next_up():
    from gpubroker.broker.control.reconfig import next_up_notes

    base = {
        "gpu": {"device": "cpu", "capacity": "1GiB"},
        "models": {"m": {"model": "mlp", "quota": {"min": "32MiB", "base": "64MiB", "max": "128MiB"}}},
    }
    old = parse_config(base, "old")
    new = parse_config({**base, "broker": {"direct_ingress": True}}, "new")
    assert next_up_notes(old, new) == ["broker.direct_ingress takes effect on the next `gpubroker up`"]
    assert next_up_notes(old, old) == []
