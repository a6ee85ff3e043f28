"""Placement: the card of every replica, decided once when the fleet is deployed (pure).

A model's quota is per card: every card it runs on holds its own ``min <= base <= max``, shared
by its replicas there, so a replica on a new card costs a base and one beside its own costs only
its process. First-fit decreasing places every model's first replica (largest base first) before
any second one, then spreads the rest in rounds (``placement.spread``: a new card, a new node
first; else the model's own smallest group). Nothing fits: ``PlacementError`` naming the model, its
need and each card's free bytes. ``replace_after_loss`` keeps the surviving replicas and places the
lost ones by the same rules, counting the rest in ``unplaced``. Deterministic and frozen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpubroker.quotas.cards import Card, CardBudget, budget_from_gpu, fleet_cards
from gpubroker.quotas.sizes import format_size

DEFAULT_CUDA_CONTEXT_BYTES = (
    512 * 1024**2
)  # as gpubroker.quotas.config (kept here so placement does not import the schema)


@dataclass(frozen=True)
class ModelDemand:
    """What one model asks of the cards."""

    name: str
    base_bytes: int  # guaranteed quota it holds on every card it is placed on
    min_bytes: int  # working set (shown in errors and plans)
    max_bytes: int  # most it may borrow up to, per card
    replicas: int  # Serve replicas in all
    cards: tuple[str, ...] | None = None  # allowed card ids; None: any card
    node_label: tuple[tuple[str, str], ...] = ()  # only cards whose node has all these labels
    spread: bool = True  # replicas on different cards (nodes first) while they fit

    def allows(self, card: Card) -> bool:
        if self.cards is not None and card.id not in self.cards:
            return False
        return card.matches(dict(self.node_label))


class PlacementError(ValueError):
    """A model that fits nowhere. ``free_bytes``: each allowed card's free usable bytes then."""

    def __init__(self, model: str, need_bytes: int, free_bytes: Mapping[str, int], message: str):
        self.model = model
        self.need_bytes = need_bytes
        self.free_bytes = dict(free_bytes)
        super().__init__(message)


@dataclass(frozen=True)
class CardPlan:
    """One card after placement: what its ledger starts from."""

    card: Card
    usable_bytes: int  # capacity x (1 - reserve) - context per replica process placed here
    base_bytes: int  # Σ base of the models on it
    models: Mapping[str, int]  # model -> replicas on this card (read-only)

    @property
    def free_bytes(self) -> int:
        return self.usable_bytes - self.base_bytes

    @property
    def processes(self) -> int:
        return sum(self.models.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.card.to_dict(),
            "usable_bytes": self.usable_bytes,
            "base_bytes": self.base_bytes,
            "free_bytes": self.free_bytes,
            "models": dict(self.models),
        }


@dataclass(frozen=True)
class ReplicaGroup:
    """The replicas of one model on one card: one Serve deployment."""

    model: str
    card_id: str
    replicas: int


@dataclass(frozen=True)
class Placement:
    """Where every replica runs. ``replicas[model]`` is the card id of each replica, in the order
    they were placed; ``cards`` is every card of the fleet (empty ones too), in fleet order."""

    replicas: Mapping[str, tuple[str, ...]]  # model -> card id per replica (read-only)
    cards: tuple[CardPlan, ...]
    unplaced: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType({})
    )  # model -> replicas that fit nowhere (partial re-placement)

    def card_plan(self, card_id: str) -> CardPlan:
        for plan in self.cards:
            if plan.card.id == card_id:
                return plan
        raise KeyError(f"no card '{card_id}' in this placement; cards: {', '.join(p.card.id for p in self.cards)}")

    def card(self, card_id: str) -> Card:
        return self.card_plan(card_id).card

    def cards_of(self, model: str) -> tuple[str, ...]:
        """The distinct cards a model is on, in fleet card order."""
        on = set(self.replicas[model])
        return tuple(p.card.id for p in self.cards if p.card.id in on)

    def models_on(self, card_id: str) -> Mapping[str, int]:
        return self.card_plan(card_id).models

    def groups_of(self, model: str) -> dict[str, int]:
        """Card id -> replicas of ``model`` on it, cards in fleet order; {} for a model placed nowhere."""
        ids = self.replicas.get(model, ())
        return {cid: ids.count(cid) for cid in self.cards_of(model)} if ids else {}

    def groups(self) -> tuple[ReplicaGroup, ...]:
        """One (model, card, replicas) group per model per card, models by name, cards in fleet order."""
        return tuple(
            ReplicaGroup(model, cid, n) for model in sorted(self.replicas) for cid, n in self.groups_of(model).items()
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "replicas": {m: list(ids) for m, ids in sorted(self.replicas.items())},
            "cards": [p.to_dict() for p in self.cards],
            "unplaced": dict(self.unplaced),
        }


# ------------------------------------------------------------------------------ the algorithm
class _CardState:
    __slots__ = ("card", "base", "models")

    def __init__(self, card: Card) -> None:
        self.card = card
        self.base = 0
        self.models: dict[str, int] = {}

    @property
    def processes(self) -> int:
        return sum(self.models.values())

    def free(self, budget: CardBudget, extra_processes: int = 0) -> int:
        return budget.usable_bytes(self.card, self.processes + extra_processes) - self.base


def _fits(state: _CardState, demand: ModelDemand, budget: CardBudget, new_group: bool) -> bool:
    return state.free(budget, extra_processes=1) >= (demand.base_bytes if new_group else 0)


def _free_list(states: Iterable[_CardState], budget: CardBudget) -> str:
    return ", ".join(f"{s.card.id} (node {s.card.node}) {format_size(max(0, s.free(budget)))} free" for s in states)


def _fail(demand: ModelDemand, allowed: list[_CardState], budget: CardBudget, what: str) -> PlacementError:
    need = demand.base_bytes + (0 if all(s.card.emulated for s in allowed) else budget.context_bytes_per_process)
    free = {s.card.id: max(0, s.free(budget)) for s in allowed}
    return PlacementError(
        demand.name,
        need,
        free,
        f"models.{demand.name}: {what} needs {format_size(need)} (quota.base {format_size(demand.base_bytes)}"
        f"{'' if need == demand.base_bytes else ' + a CUDA context'}) of free usable memory on one card; "
        f"allowed cards: {_free_list(allowed, budget)}. Lower models.{demand.name}.quota.base or other models' bases, "
        f"allow more cards (placement), or add cards",
    )


def place(
    demands: Iterable[ModelDemand],
    cards: Iterable[Card],
    budget: CardBudget,
    *,
    keep: Mapping[str, Iterable[str]] | None = None,
    partial: bool = False,
) -> Placement:
    """Decide the card of every replica (see the module note). Raises PlacementError.

    ``keep``: replicas that already run (model -> card id per replica); those on a card of
    ``cards`` stay where they are and count first (no live migration). ``partial``: a replica
    that fits nowhere is counted in ``Placement.unplaced`` instead of raising (after a node
    loss the fleet runs short rather than over-granting)."""
    placer = _Placer(demands, cards, budget, partial)
    placer.keep_running(keep or {})  # 0. what already runs stays
    placer.pack_bases()  # 1. bin-pack the bases, first fit decreasing
    placer.spread_replicas()  # 2. spread the rest, one round per replica number
    return placer.placement()


class _Placer:
    """One placement in progress: each card's bases and replicas, each model's allowed cards,
    where its replicas went and how many fit nowhere."""

    def __init__(self, demands: Iterable[ModelDemand], cards: Iterable[Card], budget: CardBudget, partial: bool):
        self.states = [_CardState(c) for c in cards]
        self.by_id = {s.card.id: s for s in self.states}
        self.budget, self.partial = budget, partial
        self.ordered = sorted(demands, key=lambda d: (-d.base_bytes, d.name))
        self.allowed: dict[str, list[_CardState]] = {}
        self.placed: dict[str, list[str]] = {d.name: [] for d in self.ordered}
        self.unplaced: dict[str, int] = {}
        for d in self.ordered:
            self._allow(d)

    def _allow(self, d: ModelDemand) -> None:
        """The cards ``d``'s placement allows (a card id the fleet lacks, or none allowed, raises
        unless ``partial``)."""
        unknown = [c for c in d.cards or () if c not in self.by_id]
        if unknown and not self.partial:
            raise PlacementError(
                d.name,
                d.base_bytes,
                {},
                (
                    f"models.{d.name}.placement.cards: card '{unknown[0]}' is not a card of the fleet "
                    f"(cards: {', '.join(self.by_id)}); use one of those ids or write cards: any"
                ),
            )
        self.allowed[d.name] = [s for s in self.states if d.allows(s.card)]
        if self.allowed[d.name]:
            return
        if self.partial:
            self.unplaced[d.name] = d.replicas
            return
        wanted = f"cards {list(d.cards)}" if d.cards is not None else "any card"
        cards = ", ".join(f"{s.card.id} (node {s.card.node}, labels {s.card.label_map})" for s in self.states)
        raise PlacementError(
            d.name,
            d.base_bytes,
            {},
            (
                f"models.{d.name}.placement: no card matches ({wanted}, node_label {dict(d.node_label)}); the fleet's "
                f"cards: {cards}. Widen placement.cards or placement.node_label"
            ),
        )

    def put(self, d: ModelDemand, state: _CardState) -> None:
        if d.name not in state.models:
            state.base += d.base_bytes
        state.models[d.name] = state.models.get(d.name, 0) + 1
        self.placed[d.name].append(state.card.id)

    def short(self, d: ModelDemand, what: str) -> None:
        if not self.partial:
            raise _fail(d, self.allowed[d.name], self.budget, what)
        self.unplaced[d.name] = self.unplaced.get(d.name, 0) + 1

    def keep_running(self, keep: Mapping[str, Iterable[str]]) -> None:
        """Replicas that already run on an allowed card stay there; kept replicas over a card's
        usable memory raise (re-placing cannot fix them: the fleet must be redeployed)."""
        for d in self.ordered:
            for cid in keep.get(d.name, ()):
                state = self.by_id.get(cid)
                if (
                    state is not None
                    and state in self.allowed.get(d.name, ())
                    and len(self.placed[d.name]) < d.replicas
                ):
                    self.put(d, state)
        over = [s for s in self.states if s.free(self.budget) < 0]
        if over:
            raise PlacementError(
                next(iter(over[0].models)),
                0,
                {s.card.id: s.free(self.budget) for s in over},
                (
                    f"the replicas kept on card {over[0].card.id} ({', '.join(over[0].models)}) need more than its "
                    f"usable {_free_list(over, self.budget)}; redeploy the fleet instead of re-placing it"
                ),
            )

    def pack_bases(self) -> None:
        """Each model's first replica on the first allowed card its base fits (biggest bases first)."""
        for d in self.ordered:
            if self.placed[d.name] or d.name in self.unplaced:
                continue
            first = next((s for s in self.allowed[d.name] if _fits(s, d, self.budget, new_group=True)), None)
            if first is None:
                if not self.partial:
                    raise _fail(d, self.allowed[d.name], self.budget, "its first replica")
                self.unplaced[d.name] = d.replicas
                continue
            self.put(d, first)

    def spread_replicas(self) -> None:
        """The other replicas, one round per replica number: spread over cards and nodes, or
        together on the first replica's card."""
        rounds = max((d.replicas for d in self.ordered), default=1)
        for r in range(1, rounds):
            for d in self.ordered:
                placed = self.placed[d.name]
                if d.replicas <= r or len(placed) > r or not placed:
                    continue
                allowed = self.allowed[d.name]
                if d.spread:
                    target = _spread_target(d, allowed, self.budget)
                    mine = [s for s in allowed if d.name in s.models]
                else:  # together: every replica on the first replica's card
                    target, mine = None, [self.by_id[placed[0]]]
                if target is None:
                    room = [s for s in mine if _fits(s, d, self.budget, new_group=False)]
                    target = min(room, key=lambda s: s.models[d.name], default=None)  # min keeps the first on ties
                if target is None:
                    self.short(d, f"replica {r + 1} of {d.replicas}")
                    continue
                self.put(d, target)

    def placement(self) -> Placement:
        plans = tuple(
            CardPlan(
                s.card,
                self.budget.usable_bytes(s.card, s.processes),
                s.base,
                MappingProxyType(dict(sorted(s.models.items()))),
            )
            for s in self.states
        )
        return Placement(
            MappingProxyType({m: tuple(ids) for m, ids in sorted(self.placed.items())}),
            plans,
            MappingProxyType(dict(sorted(self.unplaced.items()))),
        )


def replace_after_loss(
    previous: Placement, demands: Iterable[ModelDemand], alive: Iterable[Card], budget: CardBudget
) -> Placement:
    """Re-place after cards are lost (or join): replicas on live cards stay, the lost ones go
    where a card has room by the same rules, and what fits nowhere is ``unplaced``."""
    return place(demands, alive, budget, keep=previous.replicas, partial=True)


def _spread_target(d: ModelDemand, allowed: list[_CardState], budget: CardBudget) -> _CardState | None:
    """A card this model is not on yet with room for its base: on a node it is not on first."""
    nodes = {s.card.node for s in allowed if d.name in s.models}
    fresh = [s for s in allowed if d.name not in s.models and _fits(s, d, budget, new_group=True)]
    return next((s for s in fresh if s.card.node not in nodes), None) or next(iter(fresh), None)


# ------------------------------------------------------------------------------ from a config
def demands_from_models(models: Mapping[str, Any]) -> tuple[ModelDemand, ...]:
    """A config's models (``gpubroker.quotas.config.ModelSpec`` by name) as demands."""
    out = []
    for name, spec in models.items():
        pl = spec.placement
        out.append(
            ModelDemand(
                name=name,
                base_bytes=int(spec.quota.base),
                min_bytes=int(spec.quota.min),
                max_bytes=int(spec.quota.max),
                replicas=int(spec.replicas),
                cards=None if pl.cards == "any" else tuple(pl.cards),
                node_label=tuple(sorted(pl.node_label.items())),
                spread=bool(pl.spread),
            )
        )
    return tuple(out)


def place_fleet(cfg: Any, discovered: tuple[Card, ...] | None = None, capacity_bytes: int | None = None) -> Placement:
    """Place a ``gpubroker.quotas.config.FleetConfig``: its cards (gpus list, discovered for gpus: auto, or the
    gpu section's one card with ``capacity_bytes`` when gpu.capacity is auto) and its models."""
    cards = fleet_cards(cfg.gpu, cfg.gpus, discovered, capacity_bytes)
    return place(demands_from_models(cfg.models), cards, budget_from_gpu(cfg.gpu, DEFAULT_CUDA_CONTEXT_BYTES))


def check_fleet_cards(cfg: Any) -> Any:
    """The config's many-card check (``FleetConfig`` with ``gpus:``): gpu.capacity/device stay auto,
    and, for a listed gpus, every model is placed within each card's usable. Returns ``cfg``;
    raises ValueError (PlacementError) naming the model and the cards. gpus: auto is checked
    once discovery has found the cards (``place_fleet(cfg, discovered)``)."""
    if cfg.gpu.capacity != "auto" or cfg.gpu.device != "auto":
        raise ValueError(
            "gpu.capacity: with gpus: each card has its own capacity and device; "
            "leave gpu.capacity and gpu.device at auto"
        )
    if cfg.gpus != "auto":
        place_fleet(cfg)
    return cfg
