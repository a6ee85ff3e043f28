"""Serve application builders: one application per model (its own ingress) plus the fleet API.

Every model is its own Serve application, named ``<fleet app>-<model>`` and routed at
``<prefix>/v1/models/<model>``: its deployment (``gpubroker.deployments.serve.http_model.HttpModel``, named
as the model) answers HTTP itself, so a request crosses one hop, proxy -> model replica. The
fleet application (``gpubroker.deployments.serve.ingress.FleetApi``, named as the fleet, at ``<prefix>/``)
answers ``/v1/status``, ``/v1/decisions``, ``/v1/models`` and every path no model owns (404
naming the known models). ``fleet_apps`` builds them all; ``run_fleet`` deploys them.

From a Ray Serve config file (``serve deploy configs/serve-demo.yaml``), one entry per app::

    applications:
      - name: gpubroker
        route_prefix: /
        import_path: gpubroker.deployments.app:build_app            # the fleet API; starts the broker
        args: {config: configs/demo.yaml}                  # or config_text: "<yaml>"
      - name: gpubroker-mlp
        route_prefix: /v1/models/mlp
        import_path: gpubroker.deployments.app:build_model_app
        args: {config: configs/demo.yaml, model: mlp}

(``python -m gpubroker.deployments.app configs/demo.yaml`` prints that file for any fleet config.)
The broker actor must be running (``gpubroker.broker.actor.start_broker``) for settings to move;
without it the replicas serve on their config's initial settings and keep retrying.
``build_app`` starts the broker itself when ``args["start_broker"]`` is true (the default).

The config is parsed once on the serving side, where its text comes in: ``build_app`` and
``build_model_app`` (``serve deploy``'s args), ``python -m`` (a user's file), and for
``gpubroker up`` its caller (``gpubroker.deployments.cluster.fleet.deploy`` gets the loaded
``FleetConfig``). Every deployment bound here gets the typed ``FleetConfig`` (a pydantic model: it
pickles, Serve carries it to the replica), never the text. The text goes only where it is hashed
or kept: each deployment's version (``gpubroker.deployments.serve.versions``) and the broker
actor, which checkpoints it and compares it on ``apply``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.serve import Application

from gpubroker.deployments.llm.openai_api import llm_app
from gpubroker.deployments.serve.http_model import HttpModel
from gpubroker.deployments.serve.ingress import FleetApi
from gpubroker.deployments.serve.versions import code_digest, deployment_version
from gpubroker.quotas.config import FleetConfig, parse_config_text

if TYPE_CHECKING:
    from gpubroker.deployments.serve.placement_resources import DeploymentPlan

FLEET_APP = "gpubroker"  # the fleet API's application name; model apps are "<fleet app>-<model>"
INGRESS_NAME = "fleet-api"  # the fleet API's deployment
LLM_APP = "openai"  # kind: llm models share one app "<fleet app>-openai" at /openai (OpenAI base_url .../openai/v1)
MODEL_NUM_CPUS = 0.1  # logical CPUs per model replica: several share a small machine
INGRESS_NUM_CPUS = 0.05
# Back-pressure is the replica's own (``max_queued`` per replica: a JSON 503 with Retry-After,
# counted by the broker). Serve's queue in the proxy, for requests waiting for a free slot of
# ``max_ongoing_requests``, is only a safety net this many times larger: a replica refuses a
# request over ``max_queued`` at once, so that queue drains as fast as requests arrive.
SERVE_QUEUE_FACTOR = 8


@dataclass(frozen=True)
class ServeApp:
    """One Serve application of a fleet: its name, route prefix and bound graph."""

    name: str
    route_prefix: str
    app: Application
    scalable: bool = (
        False  # a model app: Serve's external scaler on, for the replica targets (gpubroker.deployments.serve.scaler)
    )


def model_app_name(model: str, fleet_app: str = FLEET_APP) -> str:
    return f"{fleet_app}-{model}"


def model_route(model: str, prefix: str = "/") -> str:
    return f"{prefix.rstrip('/')}/v1/models/{model}"


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


@dataclass(frozen=True)
class AppLayout:
    """How a fleet's Serve apps are named, routed and built: the same at deploy time and for every
    re-placement (``gpubroker.deployments.serve.reconcile``)."""

    fleet_app: str = FLEET_APP  # the fleet API's app; model apps are "<fleet app>-<model>"
    prefix: str = "/"  # the fleet API's route; models under <prefix>/v1/models/<model>
    model_num_cpus: float = MODEL_NUM_CPUS  # logical CPUs per model replica
    model_cls: type = HttpModel  # the batch models' deployment class, HttpModel or a subclass


def model_deployment(
    name: str,
    cfg: FleetConfig,
    config_text: str,
    layout: AppLayout = AppLayout(),
    *,
    plans: Sequence[DeploymentPlan] | None = None,
    router: bool | None = None,
) -> Application:
    """One model's application graph: the ``layout.model_cls`` deployment, its own ingress.

    Without ``plans`` (a fleet without ``gpus:``) the model is one deployment of its configured
    replicas. A fleet with ``gpus:`` places every replica on a card (``deployment_plans``): a model on
    one card is one deployment asking for that card's resource; a model on several cards is one
    deployment per card (``<model>@<card>``) behind a ``CardRouter`` ingress. ``router`` keeps the
    router ingress even for one group (``gpubroker.deployments.serve.reconcile`` after a re-placement)."""
    from ray.serve.config import BackpressureConfig

    spec = cfg.models[name]
    model_cls = layout.model_cls

    def one(dep_name: str, replicas: int, actor_options: dict[str, Any], *args: Any) -> Application:
        actor_options = with_job_modules(actor_options)
        version = deployment_version(
            model_cls, dep_name, replicas, actor_options, (name, config_text, *args), code_digest(spec.model)
        )
        return (
            serve.deployment(model_cls)  # type: ignore[attr-defined]  # Ray types serve.deployment(cls) as the decorator, not a Deployment
            .options(
                name=dep_name,
                num_replicas=replicas,
                max_ongoing_requests=spec.max_ongoing_requests,
                max_queued_requests=SERVE_QUEUE_FACTOR * spec.max_ongoing_requests * replicas,
                backpressure_config=BackpressureConfig(retry_after_s=max(1, round(cfg.broker.control_interval_s))),
                ray_actor_options=actor_options,
                health_check_period_s=5,
                graceful_shutdown_timeout_s=5,
            )
            .options(version=version, _internal=True)  # Serve's own option; not settable otherwise
            .bind(name, cfg, *args)  # the typed config; the version hashes its text (unchanged)
        )

    if plans is None:
        return one(name, spec.replicas, {"num_cpus": layout.model_num_cpus})
    from gpubroker.deployments.serve.http_cards import CardRouter

    if len(plans) == 1 and not router:
        p = plans[0]
        return one(p.name, p.num_replicas, p.ray_actor_options, p.card_id, p.num_replicas)
    groups = {p.card_id: one(p.name, p.num_replicas, p.ray_actor_options, p.card_id, p.num_replicas) for p in plans}
    return (
        serve.deployment(CardRouter)  # type: ignore[attr-defined]  # Ray types serve.deployment(cls) as the decorator, not a Deployment
        .options(
            name=name,
            ray_actor_options={"num_cpus": INGRESS_NUM_CPUS},
            max_ongoing_requests=4096,
            graceful_shutdown_timeout_s=5,  # the old one's calls to a group that is gone end then (explicit 503)
            **surge_options(),  # a new router (re-placed groups) is up before the old one stops
        )
        .bind(name, cfg, groups, {p.card_id: p.num_replicas for p in plans})
    )


def surge_options() -> dict[str, Any]:
    """``max_surge_percent=100`` where Serve has the option (Ray 2.60+), else nothing: on older
    Serve a re-placed router replaces the old one without overlap (a request may meet a 503)."""
    import inspect

    from ray.serve.deployment import Deployment

    return {"max_surge_percent": 100} if "max_surge_percent" in inspect.signature(Deployment.options).parameters else {}


def with_job_modules(actor_options: dict[str, Any]) -> dict[str, Any]:
    """``actor_options`` with the job's ``py_modules`` (the user's packages ``gpubroker up`` ships:
    ``gpubroker.deployments.cluster.user_code``) added to a runtime_env of its own: Serve gives the job's runtime_env
    only to deployments without one (a placed replica has its card in ``env_vars``)."""
    env = actor_options.get("runtime_env")
    if not env or "py_modules" in env:
        return actor_options
    import ray

    job_env = ray.get_runtime_context().runtime_env if ray.is_initialized() else {}
    modules = (job_env or {}).get("py_modules")
    return {**actor_options, "runtime_env": {**env, "py_modules": list(modules)}} if modules else actor_options


def fleet_api(cfg: FleetConfig, app_names: dict[str, str] | None = None, reconciler: Any = None) -> Application:
    """The fleet API; ``app_names`` (model -> its Serve app; default: the default app names) are
    the apps its plan follower sets replica counts on (``gpubroker.deployments.serve.follow``); ``reconciler``
    (``gpubroker.deployments.serve.reconcile.ServeReconciler``): it also applies re-placements."""
    if app_names is None:
        app_names = {n: model_app_name(n) for n, m in cfg.models.items() if m.kind != "llm"}
    return FleetApi.options(  # type: ignore[attr-defined]  # @serve.deployment made the class a Deployment
        name=INGRESS_NAME, ray_actor_options={"num_cpus": INGRESS_NUM_CPUS}, max_ongoing_requests=1024
    ).bind(cfg, app_names, reconciler)


def fleet_apps(
    cfg: FleetConfig,
    config_text: str,
    layout: AppLayout = AppLayout(),
    *,
    cards: tuple[Any, ...] | None = None,
    reconciler: Any = None,
) -> list[ServeApp]:
    """The fleet's Serve applications: the fleet API at ``layout.prefix``, each model under it.
    With ``gpus:`` the replicas are placed on cards (``cards``: the discovered ones for ``gpus:
    auto``) and, given a ``reconciler`` (``gpubroker.deployments.serve.reconcile.ServeReconciler``), the fleet API
    applies the broker's re-placements to Serve."""
    placement = None
    if cfg.gpus is not None:
        from gpubroker.quotas.placement import place_fleet

        placement = place_fleet(cfg, cards)
    fleet_app, prefix = layout.fleet_app, layout.prefix
    scaled = {n: model_app_name(n, fleet_app) for n, m in cfg.models.items() if m.kind != "llm"}
    apps = [ServeApp(fleet_app, prefix, fleet_api(cfg, scaled, reconciler))]
    plans = None
    if placement is not None:
        from gpubroker.deployments.serve.placement_resources import deployment_plans

        plans = deployment_plans(placement, model_num_cpus=layout.model_num_cpus)
    for name, spec in cfg.models.items():
        if spec.kind == "llm":  # LLM engines: one OpenAI-compatible app for all of them (gpubroker.deployments.llm)
            continue
        mine = None if plans is None else [p for p in plans if p.model == name]
        app = model_deployment(name, cfg, config_text, layout, plans=mine)
        apps.append(ServeApp(model_app_name(name, fleet_app), model_route(name, prefix), app, scalable=True))
    if any(m.kind == "llm" for m in cfg.models.values()):
        llms = llm_app(cfg, config_text, placement=placement)  # each engine on its placed card
        apps.append(ServeApp(f"{fleet_app}-{LLM_APP}", llm_route(prefix), llms))
    return apps


def llm_route(prefix: str = "/") -> str:
    """Where the OpenAI-compatible API is: ``<route>/v1/completions``, ``<route>/v1/chat/completions``."""
    return f"{prefix.rstrip('/')}/{LLM_APP}"


def run_fleet(apps: list[ServeApp], *, wait: bool = False, logging_config: dict[str, Any] | None = None) -> None:
    """Deploy the applications in one controller call (``wait``: until all are RUNNING)."""
    from ray.serve import RunTarget, run_many

    run_many(
        [
            RunTarget(
                target=a.app,
                name=a.name,
                route_prefix=a.route_prefix,
                logging_config=logging_config,
                external_scaler_enabled=a.scalable,  # replica counts set by gpubroker.deployments.serve.scaler, no restart
            )
            for a in apps
        ],
        wait_for_ingress_deployment_creation=wait,
        wait_for_applications_running=wait,
    )


def build_app(args: dict[str, Any]) -> Application:
    """Serve builder of the fleet API app: ``{"config": path}`` or ``{"config_text": yaml}``."""
    text = config_text_from_args(args)
    cfg = parse_config_text(text, str(args.get("config", "config_text")))
    if args.get("start_broker", True):
        import ray

        if ray.is_initialized():
            from gpubroker.broker.actor import start_broker

            start_broker(text)  # the broker takes the text: it checkpoints it and hashes it for apply
    return fleet_api(cfg)


def build_model_app(args: dict[str, Any]) -> Application:
    """Serve builder of one model's app: ``{"config": path, "model": name}``."""
    text = config_text_from_args(args)
    cfg = parse_config_text(text, str(args.get("config", "config_text")))
    name = str(args.get("model", ""))
    if name not in cfg.models:
        raise ValueError(
            f"build_model_app args: model {name!r} is not in the config; use one of {', '.join(cfg.models)}"
        )
    return model_deployment(
        name, cfg, text, AppLayout(model_num_cpus=float(args.get("model_num_cpus", MODEL_NUM_CPUS)))
    )


AUTO_PROXY_ROOM_S = 90.0  # proxy_timeout_s auto: the longest request_timeout_s plus this


def http_options(cfg: FleetConfig, host: str | None = None, port: int | None = None) -> dict[str, Any]:
    """Serve's HTTP proxy options for the fleet: where it binds (the config's, unless given) and
    its end-to-end request limit (``broker.proxy_timeout_s``: a request that a dead replica took
    with it gets a 408 rather than no answer; omitted when there is none: null, or auto in a
    fleet with an LLM, whose streams may run for minutes)."""
    opts: dict[str, Any] = {"host": host or cfg.broker.http_host, "port": port or cfg.broker.http_port}
    limit = cfg.broker.proxy_timeout_s
    if limit == "auto":  # a queued request's own limit plus room for its batch; streams: none
        llm = any(m.kind == "llm" for m in cfg.models.values())
        limit = None if llm else max(m.request_timeout_s for m in cfg.models.values()) + AUTO_PROXY_ROOM_S
    if limit is not None:
        opts["request_timeout_s"] = float(limit)
    return opts


def serve_config(config_path: str, cfg: FleetConfig, fleet_app: str = FLEET_APP) -> dict[str, Any]:
    """A Ray Serve config document (``serve deploy``) with the fleet API and one app per model."""
    apps: list[dict[str, Any]] = [
        {
            "name": fleet_app,
            "route_prefix": "/",
            "import_path": "gpubroker.deployments.app:build_app",
            "args": {"config": config_path},
        }
    ]
    for name in [n for n, m in cfg.models.items() if m.kind != "llm"]:
        apps.append(
            {
                "name": model_app_name(name, fleet_app),
                "route_prefix": model_route(name),
                "import_path": "gpubroker.deployments.app:build_model_app",
                "args": {"config": config_path, "model": name},
                "external_scaler_enabled": True,  # replica counts set by gpubroker.deployments.serve.scaler
            }
        )
    if any(m.kind == "llm" for m in cfg.models.values()):
        apps.append(
            {
                "name": f"{fleet_app}-{LLM_APP}",
                "route_prefix": llm_route(),
                "import_path": "gpubroker.deployments.llm.openai_api:build_llm_app",
                "args": {"config": config_path},
            }
        )
    return {
        "proxy_location": "EveryNode",
        "http_options": http_options(cfg),
        "applications": apps,
    }


if __name__ == "__main__":  # python -m gpubroker.deployments.app configs/demo.yaml > serve.yaml
    import yaml

    # the user's file: an input, parsed here
    path = sys.argv[1] if len(sys.argv) > 1 else "configs/demo.yaml"
    doc = serve_config(path, parse_config_text(Path(path).read_text(encoding="utf-8"), path))
    sys.stdout.write(yaml.safe_dump(doc, sort_keys=False))
