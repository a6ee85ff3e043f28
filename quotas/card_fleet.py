"""One card of a many-card fleet as a fleet of its own: what the simulator runs for ``--card``
(``card_fleet``), and what the broker's core for that card runs (``card_config``).

Lending happens only inside a card (one ledger per card), so a card's models with the card's
capacity, device and the fleet's shared ``gpu`` settings behave as a one-card fleet: each model
holds its quota there with the replicas placement puts on that card (``gpubroker.quotas.placement``). What
such a fleet does not carry: the other cards of a model placed on several (their replicas and
their share of its requests).
"""

from __future__ import annotations

from gpubroker.quotas.config import FleetConfig, parse_config
from gpubroker.quotas.placement import Placement, place_fleet


def card_fleet(cfg: FleetConfig, card_id: str, source: str = "config") -> FleetConfig:
    """The models placed on ``card_id`` of ``cfg`` (a listed ``gpus:`` fleet) as a one-card fleet.
    Raises ValueError naming the fix for a fleet without listed cards or an unknown card."""
    if cfg.gpus is None:
        raise ValueError(f"{source} has one card (the gpu section), not a gpus list; leave out --card")
    if cfg.gpus == "auto":
        raise ValueError(
            f"{source} says gpus: auto (cards found on the Ray cluster at start); list the cards under gpus: "
            "to simulate one of them"
        )
    placement = place_fleet(cfg)
    ids = [p.card.id for p in placement.cards]
    if card_id not in ids:
        raise ValueError(f"--card '{card_id}' is not a card of {source}; use one of {', '.join(ids)}")
    plan = placement.card_plan(card_id)
    if not plan.models:
        raise ValueError(
            f"no model is placed on card {card_id}; pick a card with models: {_cards_with_models(placement)}"
        )
    doc = card_config(cfg, placement, card_id).model_dump(mode="json")  # what the card's core runs
    del doc["gpus"]
    for spec in doc["models"].values():
        spec.pop("placement", None)
    return parse_config(doc, f"{source}, card {card_id}")


def card_config(cfg: FleetConfig, placement: Placement, card_id: str) -> FleetConfig:
    """The fleet config as one card's core sees it: its models (replicas on this card), its capacity."""
    plan = placement.card_plan(card_id)
    card = plan.card
    device = "cpu" if card.emulated else f"cuda:{card.index}"
    gpu = cfg.gpu.model_copy(update={"capacity": int(card.capacity_bytes), "device": device})
    models = {m: cfg.models[m].model_copy(update={"replicas": n}) for m, n in plan.models.items()}
    return cfg.model_copy(update={"gpu": gpu, "gpus": None, "models": models})


def _cards_with_models(placement: Placement) -> str:
    return ", ".join(f"{p.card.id} ({', '.join(p.models)})" for p in placement.cards if p.models)


__all__ = ["card_config", "card_fleet"]
