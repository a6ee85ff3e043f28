"""Serve follows the broker's re-placement: the plan's card groups become Serve apps again.

The broker publishes where every model's replicas should run (``gpubroker.broker.wire.ServePlan.groups``)
and never calls Serve; the fleet API's plan follower (``gpubroker.deployments.serve.follow``) pulls the plan and
calls ``ServeReconciler`` with the groups when the plan's version moved, and asks it which cards'
nodes are in the Ray cluster (``alive_cards``) for the broker's ``observe_cards``.

What it applies. Every model whose card groups changed is deployed again under its app name
and route (``serve.run_many`` without waiting):

- a group as deployed (same card, same replica count) is its deploy-time deployment exactly
  (name, Ray options, arguments, hence its version: ``gpubroker.deployments.app.deployment_version``), so
  Serve leaves its replicas running;
- a group that is new on its card, or whose size changed, is pinned to its card's node by label
  (``gpubroker.io/node``, or ``ray.io/node-id`` for a discovered card), told its card in its
  environment, and asks for no card resource: the card's units are held by the deploy-time
  replicas (``gpubroker.deployments.serve.placement_resources``), and the broker's placement (Σ base ≤ usable
  per card, ``gpubroker.quotas.placement.replace_after_loss``) is the guard now. A group whose size
  changed restarts (its replicas split the grant by their count, a constructor argument);
- the app keeps its shape: a model deployed behind a ``CardRouter`` keeps its router (groups
  ``<model>@<card>``; the router itself is replaced, the new one up before the old stops); a
  one-group model stays one deployment unless it now spans cards;
- a model with no replica placed gets a stand-in ingress (``Unplaced``) that answers 503 +
  ``Retry-After`` with the broker's reason, so its route answers instead of waiting for
  replicas that cannot start.

LLM engines (``kind: llm``) share one app: when one moves, the app is deployed again with the
engines that stayed exactly as deployed (their versions unchanged, so Serve leaves them and the
OpenAI ingress running) and the moved engine pinned to its new card's node like a moved group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpubroker.broker.wire import Replaced
from gpubroker.deployments.app import (
    FLEET_APP,
    INGRESS_NUM_CPUS,
    LLM_APP,
    MODEL_NUM_CPUS,
    AppLayout,
    ServeApp,
    llm_route,
    model_app_name,
    model_deployment,
    model_route,
    run_fleet,
)
from gpubroker.deployments.serve.http_api import JSON_TYPE, HttpAnswer
from gpubroker.deployments.serve.http_model import HttpModel
from gpubroker.deployments.serve.placement_resources import (
    CARD_ENV,
    CARD_INDEX_ENV,
    NODE_LABEL,
    NOSET_CUDA_ENV,
    RAY_NODE_ID_LABEL,
    DeploymentPlan,
    deployment_name,
    deployment_plans,
)
from gpubroker.quotas.cards import Card, CardDevice, fleet_cards
from gpubroker.quotas.config import FleetConfig
from gpubroker.quotas.placement import Placement, place_fleet

Groups = Mapping[str, Mapping[str, int]]  # model -> card id -> replicas (gpubroker.broker.wire.ServePlan.groups)


def deployed_groups(placement: Placement) -> dict[str, dict[str, int]]:
    """model -> card id -> replicas under ``placement`` (the deploy-time one), as a plan has them."""
    out: dict[str, dict[str, int]] = {}
    for g in placement.groups():
        out.setdefault(g.model, {})[g.card_id] = g.replicas
    return out


def moved_actor_options(card: Card, num_cpus: float) -> dict[str, Any]:
    """``ray_actor_options`` of a re-placed group: on its card's node by label, its card in its
    environment, no card resource (see the module note)."""
    env = {CARD_ENV: card.id, CARD_INDEX_ENV: str(card.index)}
    if card.device == CardDevice.CUDA:
        env.update({NOSET_CUDA_ENV: "1", "CUDA_VISIBLE_DEVICES": str(card.index)})
    selector = {RAY_NODE_ID_LABEL: card.node_id} if card.node_id else {NODE_LABEL: card.node}
    return {"num_cpus": num_cpus, "label_selector": selector, "runtime_env": {"env_vars": env}}


class Unplaced:
    """Stand-in ingress of a model none of whose replicas fits on a live card: an explicit 503."""

    def __init__(self, model: str, reason: str, retry_after_s: int) -> None:
        self.answer = HttpAnswer(
            503,
            {"detail": f"model '{model}' has no replica placed: {reason}; retry later", "unplaced": True},
            {"Retry-After": str(retry_after_s)},
        )

    async def __call__(self, request: Request) -> Response:
        a = self.answer
        return Response(a.encoded(), status_code=a.status, headers=a.headers or None, media_type=JSON_TYPE)


@dataclass(frozen=True)
class ReconcileResult:
    """What one reconcile applied."""

    redeployed: tuple[str, ...]  # models whose apps were deployed again
    unplaced: tuple[str, ...]  # of those, models with no replica placed (stand-in ingress)
    groups: dict[str, dict[str, int]]  # model -> card -> replicas, for the redeployed models
    kept: dict[str, list[str]]  # model -> deployments kept exactly as deployed (Serve leaves them be)

    def to_dict(self) -> Replaced:
        """As the follower reports it to the broker (``gpubroker.broker.wire.Replaced``)."""
        return Replaced(
            redeployed=list(self.redeployed), unplaced=list(self.unplaced), groups=self.groups, kept=self.kept
        )


class ServeReconciler:
    """Applies a plan's card groups to Serve (``__call__``) and reads which cards are alive (``alive_cards``).

    Built where the fleet is deployed, with the same arguments as ``gpubroker.deployments.app.fleet_apps``
    (``cfg`` typed, as the deployer parsed it; ``config_text`` its text, for the deployments' versions
    only, so a group as deployed keeps its version); picklable (the fleet API's replica receives it:
    ``gpubroker.deployments.serve.follow``)."""

    def __init__(
        self,
        cfg: FleetConfig,
        config_text: str,
        *,
        cards: tuple[Card, ...] | None = None,
        fleet_app: str = FLEET_APP,
        prefix: str = "/",
        model_num_cpus: float = MODEL_NUM_CPUS,
        model_cls: type = HttpModel,
    ) -> None:
        self.cfg = cfg
        self.config_text = config_text
        self.cards = cards
        self.fleet_app = fleet_app
        self.prefix = prefix
        self.model_num_cpus = model_num_cpus
        self.model_cls = model_cls
        self._cache: dict[str, Any] = {}  # deploy-time placement and plans, what Serve runs now

    def __getstate__(self) -> dict[str, Any]:  # placements hold read-only mappings: rebuilt after unpickling
        return {k: v for k, v in self.__dict__.items() if k != "_cache"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _cache={})

    # ---------------------------------------------------------------- pure parts
    def deployed(self) -> Placement:
        """The deploy-time placement (what ``fleet_apps`` deployed)."""
        if "deployed" not in self._cache:
            self._cache["deployed"] = place_fleet(self.cfg, self.cards)
        return self._cache["deployed"]

    def _as_deployed(self) -> dict[tuple[str, str], DeploymentPlan]:
        if "plans" not in self._cache:
            plans = deployment_plans(self.deployed(), model_num_cpus=self.model_num_cpus)
            self._cache["plans"] = {(p.model, p.card_id): p for p in plans}
        return self._cache["plans"]

    def plans_for(self, model: str, groups: Groups) -> tuple[list[DeploymentPlan], bool]:
        """The deployments of ``model`` under ``groups`` and whether its app is a router."""
        deployed, as_deployed = self.deployed(), self._as_deployed()
        mine = dict(groups.get(model, {}))
        router = len(deployed.cards_of(model)) > 1 or len(mine) > 1
        plans = []
        for cid, n in mine.items():
            name = deployment_name(model, cid, 2 if router else 1)
            dep = as_deployed.get((model, cid))
            if dep is not None and dep.num_replicas == n and dep.name == name:
                plans.append(dep)
            else:
                options = moved_actor_options(deployed.card(cid), self.model_num_cpus)
                plans.append(DeploymentPlan(name, model, cid, n, options))
        return plans, router

    def apps_for(
        self, groups: Groups, reasons: Mapping[str, str] | None = None
    ) -> tuple[list[ServeApp], ReconcileResult]:
        """The apps to deploy again so that Serve runs ``groups`` (the plan's), and what that changes."""
        cfg = self.cfg
        deployed = self.deployed()
        current = self._cache.get("current") or deployed_groups(deployed)
        apps: list[ServeApp] = []
        redeployed: list[str] = []
        unplaced: list[str] = []
        changed: dict[str, dict[str, int]] = {}
        kept: dict[str, list[str]] = {}
        as_deployed = list(self._as_deployed().values())
        moved_llms = []
        for model, spec in cfg.models.items():
            if dict(current.get(model, {})) == dict(groups.get(model, {})):
                continue
            if spec.kind == "llm":  # the engines share one app: deployed once below
                moved_llms.append(model)
                continue
            redeployed.append(model)
            changed[model] = dict(groups.get(model, {}))
            route, app_name = model_route(model, self.prefix), model_app_name(model, self.fleet_app)
            plans, router = self.plans_for(model, groups)
            if not plans:
                unplaced.append(model)
                why = (reasons or {}).get(model, "it fits on no live card")
                retry = max(1, round(cfg.broker.control_interval_s))
                from ray import serve

                app = (
                    serve.deployment(Unplaced)  # type: ignore[attr-defined]  # Ray types serve.deployment(cls) as the decorator, not a Deployment
                    .options(name=model, ray_actor_options={"num_cpus": INGRESS_NUM_CPUS}, max_ongoing_requests=4096)
                    .bind(model, why, retry)
                )
                apps.append(ServeApp(app_name, route, app))
                kept[model] = []
                continue
            kept[model] = [p.name for p in plans if p in as_deployed]
            layout = AppLayout(self.fleet_app, self.prefix, self.model_num_cpus, self.model_cls)
            app = model_deployment(model, cfg, self.config_text, layout, plans=plans, router=router)
            apps.append(ServeApp(app_name, route, app))
        if moved_llms:
            apps.append(self._llm_app(groups, moved_llms, redeployed, unplaced, changed, kept))
        return apps, ReconcileResult(tuple(redeployed), tuple(unplaced), changed, kept)

    def _llm_app(
        self,
        groups: Groups,
        moved: list[str],
        redeployed: list[str],
        unplaced: list[str],
        changed: dict[str, dict[str, int]],
        kept: dict[str, list[str]],
    ) -> ServeApp:
        """The LLM app again, every engine from ``groups`` as a batch group is (``plans_for``):
        one on its deploy-time card exactly as deployed (same version: Serve leaves it, and the
        ingress, running), one on another card pinned to that card's node (``moved_actor_options``:
        the same options, so the same version, for as long as it stays there). An engine with no
        card left keeps its deploy-time options and waits for its card's node (its requests wait
        or time out; it is reported unplaced)."""
        from gpubroker.deployments.llm.openai_api import LLM_NUM_CPUS, llm_app, llm_spots

        deployed = self.deployed()
        spots = llm_spots(deployed, LLM_NUM_CPUS)
        many = len(deployed.cards) > 1
        for model, spec in self.cfg.models.items():
            if spec.kind != "llm":
                spots.pop(model, None)
                continue
            cards = tuple(groups.get(model, {}))
            if cards and cards[0] not in deployed.cards_of(model):
                spots[model] = (cards[0] if many else "", moved_actor_options(deployed.card(cards[0]), LLM_NUM_CPUS))
            if model in moved:
                redeployed.append(model)
                changed[model] = dict(groups.get(model, {}))
                kept[model] = []
                if not cards:
                    unplaced.append(model)
        return ServeApp(
            f"{self.fleet_app}-{LLM_APP}", llm_route(self.prefix), llm_app(self.cfg, self.config_text, spots=spots)
        )

    # ---------------------------------------------------------------- Ray and Serve
    def __call__(self, groups: Groups, reasons: Mapping[str, str] | None = None) -> Replaced:
        """Deploy the changed models' apps (not waiting for them to run); returns what it did."""
        apps, result = self.apps_for(groups, reasons)
        if apps:
            run_fleet(apps, wait=False, logging_config={"enable_access_log": False})
        self._cache["current"] = {m: dict(g) for m, g in groups.items()}
        return result.to_dict()

    def alive_cards(self) -> set[str]:
        """The fleet's cards whose node is alive in the Ray cluster now."""
        import ray

        from gpubroker.deployments.cluster.discovery import card_nodes

        nodes = ray.nodes()
        alive = {str(n["NodeID"]) for n in nodes if n.get("Alive", True)}
        listed = set(card_nodes(nodes))
        every = fleet_cards(self.cfg.gpu, self.cfg.gpus, self.cards)
        return {c.id for c in every if c.id in listed or (c.node_id is not None and c.node_id in alive)}
