"""A placement (``gpubroker.quotas.placement``) as Ray resources and Serve deployments.

Every card is a Ray custom resource on the node that holds it, ``gpubroker_card_<id>: 1000``
(``CARD_RESOURCE_UNITS``), declared when the node starts (``ray start --resources``, or
``Cluster.add_node(resources=...)``; ``node_start_args`` / ``node_resources`` write them). A
replica placed on a card asks for ``1000 // replicas on that card`` of it, so Ray can only
start it on that card's node, and never more replicas there than were placed. On a real GPU
it also asks for the same share of ``num_gpus`` (Ray's GPU accounting) and pins its process
to the card's CUDA ordinal (``CUDA_VISIBLE_DEVICES=<index>`` with Ray's own setting turned
off: Ray would pick *a* GPU of the node for a fractional request, not necessarily this one).
A discovered card (``gpus: auto``, it has a Ray node id) is pinned by the node's
``ray.io/node-id`` label instead, as a running node cannot declare new resources.
Each replica's environment names its card (``GPUBROKER_CARD_ID``, ``GPUBROKER_CARD_INDEX``),
which is how the replica and its reports know their card.

One Serve deployment per (model, card) group: named ``<model>`` when the model is on one card
(so a one-card fleet keeps today's names) and ``<model>@<card>`` otherwise.

Call from ``gpubroker.deployments.app`` (this module builds the deployments, app.py wires the ingress)::

    groups = bind_model_groups(cfg, model_num_cpus=MODEL_NUM_CPUS)
    # gpus: auto: bind_model_groups(cfg, place_fleet(cfg, discover_cards()), ...)
    # groups: {model: {card_id: bound deployment}}; route a model's requests over its groups
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpubroker.quotas.cards import SINGLE_CARD_ID, Card, CardDevice
from gpubroker.quotas.placement import Placement

CARD_RESOURCE_PREFIX = "gpubroker_card_"
CARD_RESOURCE_UNITS = 1000  # a card's whole custom resource; replicas share it
NODE_LABEL = "gpubroker.io/node"  # node label naming the logical node of the cards
CARD_ENV = "GPUBROKER_CARD_ID"
CARD_INDEX_ENV = "GPUBROKER_CARD_INDEX"
NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
RAY_NODE_ID_LABEL = "ray.io/node-id"  # Ray's own label on every node


def card_resource(card_id: str) -> str:
    """The Ray custom resource of a card."""
    return f"{CARD_RESOURCE_PREFIX}{card_id}"


def node_resources(cards: Iterable[Card]) -> dict[str, float]:
    """The custom resources a node declares for its cards (``ray start --resources``)."""
    return {card_resource(c.id): float(CARD_RESOURCE_UNITS) for c in cards}


def node_labels(node: str, cards: Iterable[Card]) -> dict[str, str]:
    """The labels a node declares: its logical name and its cards' node labels."""
    labels = {NODE_LABEL: node}
    for card in cards:
        labels.update(card.label_map)
    return labels


def node_start_args(node: str, cards: Iterable[Card]) -> list[str]:
    """``ray start`` arguments declaring a node's cards (resources) and labels, e.g. for the README."""
    mine = [c for c in cards if c.node == node]
    if not mine:
        raise ValueError(f"no card is on node '{node}'; the cards' nodes are {sorted({c.node for c in cards})}")
    labels = ",".join(f"{k}={v}" for k, v in sorted(node_labels(node, mine).items()))
    return ["--resources", json.dumps({k: int(v) for k, v in node_resources(mine).items()}), "--labels", labels]


def replica_actor_options(card: Card, replicas_on_card: int, num_cpus: float) -> dict[str, Any]:
    """``ray_actor_options`` for one replica placed on ``card``, which holds ``replicas_on_card``
    replica processes in all (every model's, from ``CardPlan.processes``)."""
    if replicas_on_card < 1:
        raise ValueError(f"replicas_on_card is {replicas_on_card}; a card a replica is placed on holds at least 1")
    share = CARD_RESOURCE_UNITS // replicas_on_card
    if share < 1:
        raise ValueError(
            f"card {card.id} holds {replicas_on_card} replicas, more than its {CARD_RESOURCE_UNITS} resource "
            "units; place fewer replicas on it"
        )
    env = {CARD_ENV: card.id, CARD_INDEX_ENV: str(card.index)}
    options: dict[str, Any] = {"num_cpus": num_cpus}
    if card.node_id is None:  # a listed card: its node declares the card resource
        options["resources"] = {card_resource(card.id): float(share)}
    else:  # a discovered card: a running node cannot declare new resources; pin by node id
        options["label_selector"] = {RAY_NODE_ID_LABEL: card.node_id}
    if card.device == CardDevice.CUDA:
        options["num_gpus"] = round(share / CARD_RESOURCE_UNITS, 4)
        env.update({NOSET_CUDA_ENV: "1", "CUDA_VISIBLE_DEVICES": str(card.index)})
    options["runtime_env"] = {"env_vars": env}
    return options


def deployment_name(model: str, card_id: str, cards_of_model: int) -> str:
    """``<model>`` when the model is on one card, else ``<model>@<card>``."""
    return model if cards_of_model == 1 else f"{model}@{card_id}"


@dataclass(frozen=True)
class DeploymentPlan:
    """One Serve deployment: the replicas of one model on one card."""

    name: str  # Serve deployment name
    model: str  # the config's model name
    card_id: str  # the card its replicas run on
    num_replicas: int  # replicas of the model on this card
    ray_actor_options: dict[str, Any]  # from replica_actor_options


def deployment_plans(
    placement: Placement, *, model_num_cpus: float, use_card_resources: bool | None = None
) -> tuple[DeploymentPlan, ...]:
    """The deployments of a placement, models by name, cards in fleet order.

    ``use_card_resources``: ask for the card resources (default: unless the fleet is the one
    card of a ``gpu:`` section, whose node declares no card resource; that fleet keeps today's
    options, ``num_cpus`` only)."""
    single = [p.card.id for p in placement.cards] == [SINGLE_CARD_ID]
    use = (not single) if use_card_resources is None else use_card_resources
    plans = []
    for group in placement.groups():
        plan = placement.card_plan(group.card_id)
        options = (
            replica_actor_options(plan.card, plan.processes, model_num_cpus) if use else {"num_cpus": model_num_cpus}
        )
        plans.append(
            DeploymentPlan(
                deployment_name(group.model, group.card_id, len(placement.cards_of(group.model))),
                group.model,
                group.card_id,
                group.replicas,
                options,
            )
        )
    return tuple(plans)


def fleet_plans(
    cfg: Any, placement: Placement | None = None, *, model_num_cpus: float, use_card_resources: bool | None = None
) -> tuple[DeploymentPlan, ...]:
    """The deployments of a ``FleetConfig``: of ``placement`` when given; else a fleet without
    ``gpus:`` is one deployment per model on its one card, named as the model, with today's
    options (no capacity needed), and a listed ``gpus:`` fleet is placed here
    (``gpus: auto`` needs ``place_fleet(cfg, discover_cards())`` passed in)."""
    if placement is None and cfg.gpus is None:
        return tuple(
            DeploymentPlan(name, name, SINGLE_CARD_ID, int(spec.replicas), {"num_cpus": model_num_cpus})
            for name, spec in sorted(cfg.models.items())
        )
    if placement is None:
        from gpubroker.quotas.placement import place_fleet

        placement = place_fleet(cfg)
    return deployment_plans(placement, model_num_cpus=model_num_cpus, use_card_resources=use_card_resources)


def bind_model_groups(
    cfg: Any,
    placement: Placement | None = None,
    *,
    model_num_cpus: float,
    deployment_cls: Any = None,
    use_card_resources: bool | None = None,
) -> dict[str, dict[str, Any]]:
    """Bound Serve deployments, ``{model: {card_id: Application}}``, one per (model, card) group
    (``fleet_plans``), with the options ``gpubroker.deployments.app.model_deployment`` gives a model
    (the queue bound per group); each replica gets the typed ``cfg``."""
    from ray import serve

    if deployment_cls is None:
        from gpubroker.deployments.replica.deployment import ModelReplica

        deployment_cls = ModelReplica
    if placement is None and cfg.gpus is not None:
        from gpubroker.quotas.placement import place_fleet

        placement = place_fleet(cfg)
    many = placement is not None and len(placement.cards) > 1  # replicas of a one-card fleet get card_id ""
    out: dict[str, dict[str, Any]] = {}
    for plan in fleet_plans(cfg, placement, model_num_cpus=model_num_cpus, use_card_resources=use_card_resources):
        spec = cfg.models[plan.model]
        out.setdefault(plan.model, {})[plan.card_id] = (
            serve.deployment(deployment_cls)  # type: ignore[attr-defined]  # Ray types serve.deployment(cls) as the decorator, not a Deployment
            .options(
                name=plan.name,
                num_replicas=plan.num_replicas,
                max_ongoing_requests=spec.max_ongoing_requests,
                max_queued_requests=spec.max_queued * plan.num_replicas,
                ray_actor_options=plan.ray_actor_options,
                health_check_period_s=5,
                graceful_shutdown_timeout_s=5,
            )
            .bind(plan.model, cfg, plan.card_id if many else "", plan.num_replicas)
        )
    return out
