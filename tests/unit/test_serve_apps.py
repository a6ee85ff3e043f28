"""gpubroker.deployments.app without a cluster: one Serve app per model (its own route prefix) beside the
fleet API, and the shipped Serve config (configs/serve-demo.yaml) in step with configs/demo.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpubroker.deployments.app import AppLayout, fleet_apps, model_app_name, model_route, serve_config
from gpubroker.quotas.config import load_config, parse_config_text

ROOT = Path(__file__).resolve().parents[2]


def test_every_model_is_its_own_app_under_the_fleet_prefix():
    cfg = load_config(ROOT / "configs/demo.yaml")
    text = (ROOT / "configs/demo.yaml").read_text()
    apps = fleet_apps(cfg, text, AppLayout(fleet_app="f", prefix="/arm"))
    assert apps[0].name == "f" and apps[0].route_prefix == "/arm"
    assert {(a.name, a.route_prefix) for a in apps[1:]} == {(f"f-{n}", f"/arm/v1/models/{n}") for n in cfg.models}
    assert model_app_name("mlp") == "gpubroker-mlp" and model_route("mlp") == "/v1/models/mlp"


def test_serve_demo_yaml_matches_the_demo_fleet():
    cfg = load_config(ROOT / "configs/demo.yaml")
    shipped = yaml.safe_load((ROOT / "configs/serve-demo.yaml").read_text())
    assert shipped == serve_config("configs/demo.yaml", cfg)


def test_the_proxy_gets_the_fleets_request_limit_and_a_bad_one_is_refused_by_name():
    from gpubroker.deployments.app import http_options
    from gpubroker.quotas.config import ConfigError

    text = (ROOT / "configs/demo.yaml").read_text()
    cfg = load_config(ROOT / "configs/demo.yaml")
    assert http_options(cfg) == {"host": "127.0.0.1", "port": 8000, "request_timeout_s": 120.0}  # the default
    assert http_options(cfg, "127.0.0.1", 9000)["port"] == 9000

    def with_limit(value: str) -> dict:
        return http_options(
            parse_config_text(text.replace("  http_port: 8000", f"  http_port: 8000\n  proxy_timeout_s: {value}"), "t")
        )

    assert "request_timeout_s" not in with_limit("null")  # no limit: Serve's own default
    assert with_limit("45")["request_timeout_s"] == 45.0
    longest = text.replace("slo_p95_ms: 300", "slo_p95_ms: 300\n    request_timeout_s: 200", 1)
    assert "request_timeout_s: 200" in longest
    assert http_options(parse_config_text(longest, "t"))["request_timeout_s"] == 290.0  # auto: 200 + 90
    llm = load_config(ROOT / "configs/llm-demo.yaml")
    assert llm.broker.proxy_timeout_s == "auto" and "request_timeout_s" not in http_options(llm)  # streams
    for bad in ("0", "-5", "soon"):
        with pytest.raises(ConfigError, match=r"broker\.proxy_timeout_s"):
            with_limit(bad)


def test_changing_the_proxy_limit_by_apply_says_it_takes_the_next_up():
    from gpubroker.broker.control.reconfig import next_up_notes

    text = (ROOT / "configs/demo.yaml").read_text()
    old = load_config(ROOT / "configs/demo.yaml")
    new = parse_config_text(text.replace("  http_port: 8000", "  http_port: 8000\n  proxy_timeout_s: 45"), "t")
    assert next_up_notes(old, new) == ["broker.proxy_timeout_s takes effect on the next `gpubroker up`"]


def test_the_builders_parse_the_text_once_and_bind_the_typed_config():
    """``serve deploy``'s builders parse the YAML they are given; the deployments they bind get the
    typed ``FleetConfig`` (Serve pickles it to the replica), never the text."""
    import cloudpickle

    from gpubroker.deployments.app import build_app, build_model_app
    from gpubroker.quotas.config import FleetConfig

    text = (ROOT / "configs/demo.yaml").read_text()
    fleet = build_app({"config_text": text, "start_broker": False})._bound_deployment  # noqa: SLF001
    model = build_model_app({"config_text": text, "model": "mlp"})._bound_deployment  # noqa: SLF001
    assert isinstance(fleet.init_args[0], FleetConfig) and model.init_args[:1] == ("mlp",)
    cfg = model.init_args[1]
    assert isinstance(cfg, FleetConfig) and cfg == parse_config_text(text, "t")
    carried = cloudpickle.loads(cloudpickle.dumps(model.init_args))
    assert carried[1] == cfg and carried[1].config_hash() == cfg.config_hash()
