"""deployments.app without a cluster: one Serve app per model (its own route prefix) beside the
fleet API, and the shipped Serve config (configs/serve-demo.yaml) in step with configs/demo.yaml."""

from __future__ import annotations

from pathlib import Path

import yaml

from deployments.app import fleet_apps, model_app_name, model_route, serve_config
from quotas.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_every_model_is_its_own_app_under_the_fleet_prefix():
    cfg = load_config(ROOT / "configs/demo.yaml")
    text = (ROOT / "configs/demo.yaml").read_text()
    apps = fleet_apps(cfg, text, fleet_app="f", prefix="/arm")
    assert apps[0].name == "f" and apps[0].route_prefix == "/arm"
    assert {(a.name, a.route_prefix) for a in apps[1:]} == {(f"f-{n}", f"/arm/v1/models/{n}") for n in cfg.models}
    assert model_app_name("mlp") == "gpubroker-mlp" and model_route("mlp") == "/v1/models/mlp"


def test_serve_demo_yaml_matches_the_demo_fleet():
    cfg = load_config(ROOT / "configs/demo.yaml")
    shipped = yaml.safe_load((ROOT / "configs/serve-demo.yaml").read_text())
    assert shipped == serve_config("configs/demo.yaml", cfg)


def test_the_proxy_gets_the_fleets_request_limit_and_a_bad_one_is_refused_by_name():
    from deployments.app import http_options
    from quotas.config import ConfigError, parse_config_text

    text = (ROOT / "configs/demo.yaml").read_text()
    cfg = load_config(ROOT / "configs/demo.yaml")
    assert http_options(cfg) == {"host": "127.0.0.1", "port": 8000, "request_timeout_s": 120.0}  # the default
    assert http_options(cfg, "127.0.0.1", 9000)["port"] == 9000
    off = parse_config_text(text.replace("  http_port: 8000", "  http_port: 8000\n  proxy_timeout_s: null"), "t")
    assert "request_timeout_s" not in http_options(off)  # null: Serve's own default, no limit
    try:
        parse_config_text(text.replace("  http_port: 8000", "  http_port: 8000\n  proxy_timeout_s: 0"), "t")
    except ConfigError as exc:
        assert "broker.proxy_timeout_s" in str(exc)
    else:
        raise AssertionError("proxy_timeout_s: 0 was accepted")
