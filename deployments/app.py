"""Serve application builder: one deployment per model (named as the model) plus the ingress.

Usable from a Ray Serve config file (``serve deploy configs/serve-demo.yaml``)::

    applications:
      - name: gpubroker
        import_path: deployments.app:build_app
        args: {config: configs/demo.yaml}       # or config_text: "<yaml>"

and from Python (``serve.run(build_app({"config": path}))``). The broker actor must be
running (``broker.actor.start_broker``) for settings to move; without it the replicas serve
on their config's initial settings and keep retrying. ``build_app`` starts the broker itself
when ``args["start_broker"]`` is true (the default under ``serve deploy``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from deployments.ingress import Ingress
from deployments.replica import ModelReplica
from quotas.config import FleetConfig, parse_config_text

INGRESS_NAME = "ingress"
MODEL_NUM_CPUS = 0.1  # logical CPUs per model replica: several share a small machine
INGRESS_NUM_CPUS = 0.05


def config_text_from_args(args: dict[str, Any]) -> str:
    if "config_text" in args and args["config_text"]:
        return str(args["config_text"])
    if "config" in args and args["config"]:
        path = Path(str(args["config"]))
        if not path.is_absolute() and not path.exists():
            # `serve deploy` builds the app in a Ray worker whose working directory is not the
            # checkout: a relative path is taken relative to the project root.
            root_relative = Path(__file__).resolve().parents[1] / path
            if root_relative.exists():
                path = root_relative
        return path.read_text(encoding="utf-8")
    raise ValueError("build_app args need 'config' (a path to a fleet YAML) or 'config_text' (the YAML itself)")


def build_fleet(cfg: FleetConfig, config_text: str, *, model_num_cpus: float = MODEL_NUM_CPUS) -> Application:
    handles = {}
    for name, spec in cfg.models.items():
        handles[name] = serve.deployment(ModelReplica).options(
            name=name,
            num_replicas=spec.replicas,
            max_ongoing_requests=spec.max_ongoing_requests,
            max_queued_requests=spec.max_queued * spec.replicas,
            ray_actor_options={"num_cpus": model_num_cpus},
            health_check_period_s=5,
            graceful_shutdown_timeout_s=5,
        ).bind(name, config_text)
    return Ingress.options(
        name=INGRESS_NAME,
        ray_actor_options={"num_cpus": INGRESS_NUM_CPUS},
        max_ongoing_requests=4096,
    ).bind(handles, config_text)


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve application builder: ``{"config": path}`` or ``{"config_text": yaml}``."""
    text = config_text_from_args(args)
    cfg = parse_config_text(text, str(args.get("config", "config_text")))
    if args.get("start_broker", True):
        import ray

        if ray.is_initialized():
            from broker.actor import start_broker

            start_broker(text)
    return build_fleet(cfg, text, model_num_cpus=float(args.get("model_num_cpus", MODEL_NUM_CPUS)))
