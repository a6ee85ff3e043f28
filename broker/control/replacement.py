"""Re-placement after cards are lost or join (pure): what moves, what stays, what fits nowhere.

Wraps ``gpubroker.quotas.placement.replace_after_loss`` for the broker: the result keeps every card of the
fleet in order (a lost card stays, empty, so status shows it ``live: false``), names the models
whose card groups changed (their Serve apps are redeployed) and the cards whose model sets changed
(their cores are rebuilt), and gives each unplaced model a reason naming its need and each live
card's free bytes. No Ray, no clock: the broker passes the lost cards in.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gpubroker.quotas.cards import CardBudget, budget_from_gpu
from gpubroker.quotas.placement import (
    DEFAULT_CUDA_CONTEXT_BYTES,
    CardPlan,
    ModelDemand,
    Placement,
    demands_from_models,
    place,
    replace_after_loss,
)
from gpubroker.quotas.sizes import format_size


class FleetEntry(StrEnum):
    """Decision-log kinds of the many-card broker (``gpubroker.broker.fleet_core``)."""

    CARD = "card"  # a card lost, or live again
    PLACEMENT = "placement"  # a model re-placed, or replicas that fit nowhere (names the model and why)


@dataclass(frozen=True)
class Replacement:
    """A re-placement decision (``replace_fleet``)."""

    placement: Placement  # every card of the fleet, fleet order; lost cards empty
    models_changed: tuple[str, ...]  # models whose (card -> replicas) groups changed: redeploy their apps
    cards_changed: tuple[str, ...]  # cards whose (model -> replicas) changed: rebuild their cores
    unplaced: Mapping[str, int]  # model -> replicas that fit on no live card
    reasons: Mapping[str, str]  # model -> why its unplaced replicas fit nowhere

    @property
    def changed(self) -> bool:
        return bool(self.models_changed or self.cards_changed)


def _why(d: ModelDemand, placement: Placement, alive: set[str], budget: CardBudget) -> str:
    allowed = [p for p in placement.cards if p.card.id in alive and d.allows(p.card)]
    if not allowed:
        where = f"cards {list(d.cards)}" if d.cards is not None else "any card"
        labels = f", node_label {dict(d.node_label)}" if d.node_label else ""
        return f"no live card matches its placement ({where}{labels}); it returns when such a card joins"
    free = ", ".join(
        f"{p.card.id} {format_size(max(0, p.free_bytes))} free" + (" (has it)" if d.name in p.models else "")
        for p in allowed
    )
    return (
        f"needs quota.base {format_size(d.base_bytes)} free on a live card it may use (or a card it is on with room "
        f"for one more process); allowed live cards: {free}"
    )


def _every_card(new: Placement, cards: list[Any], budget: CardBudget) -> Placement:
    """``new`` with every card of the fleet, in fleet order (the ones it did not place on, empty)."""
    plans = {p.card.id: p for p in new.cards}
    full = tuple(plans.get(c.id) or CardPlan(c, budget.usable_bytes(c, 0), 0, MappingProxyType({})) for c in cards)
    return Placement(new.replicas, full, new.unplaced)


def write_placement(path: Path, placement: Placement, lost: Iterable[str], version: int, launch_hash: str) -> None:
    """Save what a restarted broker needs to run the placement Serve runs (beside its checkpoint)."""
    replicas = {m: list(ids) for m, ids in placement.replicas.items()}
    doc = {"launch_hash": launch_hash, "version": version, "lost": sorted(lost), "replicas": replicas}
    path.write_text(json.dumps(doc), encoding="utf-8")


def read_placement(
    path: Path, launch_hash: str, deployed: Placement, cfg: Any
) -> tuple[Placement, set[str], int] | None:
    """The saved placement again, with its lost cards and version; None when there is none for
    this launch config. Its replicas are kept where they ran (``place`` with ``keep``: same rules,
    same result) on every card but the lost ones. Raises ValueError on a file it cannot use."""
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("launch_hash") != launch_hash:
            return None
        cards = [p.card for p in deployed.cards]
        gone = set(saved["lost"])
        budget = budget_from_gpu(cfg.gpu, DEFAULT_CUDA_CONTEXT_BYTES)
        alive = [c for c in cards if c.id not in gone]
        new = place(demands_from_models(cfg.models), alive, budget, keep=saved["replicas"], partial=True)
        return _every_card(new, cards, budget), gone, int(saved["version"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a saved placement ({exc!r})") from exc


def replace_fleet(previous: Placement, cfg: Any, lost: Iterable[str]) -> Replacement:
    """Re-place ``cfg``'s models (a ``gpubroker.quotas.config.FleetConfig``) on every card of ``previous``
    except ``lost``; see the module note."""
    gone = set(lost)
    cards = [p.card for p in previous.cards]
    alive = [c for c in cards if c.id not in gone]
    budget = budget_from_gpu(cfg.gpu, DEFAULT_CUDA_CONTEXT_BYTES)
    demands = demands_from_models(cfg.models)
    new = replace_after_loss(previous, demands, alive, budget)
    placement = _every_card(new, cards, budget)
    models = tuple(
        m for m in sorted(set(previous.replicas) | set(new.replicas)) if previous.groups_of(m) != placement.groups_of(m)
    )
    before = {p.card.id: dict(p.models) for p in previous.cards}
    changed_cards = tuple(p.card.id for p in placement.cards if dict(p.models) != before.get(p.card.id, {}))
    alive_ids = {c.id for c in alive}
    reasons = {d.name: _why(d, placement, alive_ids, budget) for d in demands if new.unplaced.get(d.name)}
    return Replacement(
        placement,
        models,
        changed_cards,
        MappingProxyType(dict(new.unplaced)),
        MappingProxyType(dict(sorted(reasons.items()))),
    )
