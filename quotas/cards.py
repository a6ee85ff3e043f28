"""Cards: the GPUs (or emulated cards) a fleet spans, and where each model may run.

The YAML has two forms. Today's ``gpu:`` section alone means one card (id ``card0``). A
``gpus:`` section beside it lists the cards of a Ray cluster::

    gpus: auto                 # every GPU of every node (gpubroker.deployments.cluster.discovery)

    gpus:                      # or explicitly; device: cpu emulates a card (capacity required)
      - {id: a0, node: node-a, index: 0, capacity: 1GiB, device: cpu}
      - {id: a1, node: node-a, index: 1, capacity: 1GiB, device: cpu}

With ``gpus:`` the ``gpu:`` section still holds what every card shares (``reserve_frac``,
``emergency_free_frac``, ``context_overhead``); its ``device`` and ``capacity`` stay ``auto``.
Each model says where it may run::

    placement: {cards: any | [a0, b1], node_label: {zone: east}, spread: true}

This module is pure (pydantic and the stdlib): the schema pieces, the resolved ``Card`` and the
per-card usable arithmetic. ``gpubroker.quotas.placement`` decides the card of every replica.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainSerializer,
    Tag,
    field_validator,
    model_validator,
)

from gpubroker.quotas.sizes import format_size, parse_size

SINGLE_CARD_ID = "card0"  # the one card of a fleet without a gpus: section
SINGLE_CARD_NODE = "local"
CARD_ID_PATTERN = r"[a-z0-9][a-z0-9_-]{0,62}"

_Size = Annotated[int, BeforeValidator(parse_size), PlainSerializer(format_size, return_type=str)]


class CardDevice(StrEnum):
    CPU = "cpu"  # an emulated card: host memory stands in for VRAM (tests, laptops)
    CUDA = "cuda"  # a real GPU


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class CardSpec(_Strict):
    id: str = Field(
        description="Card id, unique in the fleet (lower-case letters, digits, '-', '_'); names the Ray resource gpubroker_card_<id>."
    )
    node: str = Field(
        description="Node the card is on: the value of its node's gpubroker.io/node label, its Ray node name or IP, or its Ray node id."
    )
    index: int = Field(
        0,
        ge=0,
        le=1023,
        description="GPU index on that node (CUDA ordinal); for emulated cards an ordinal of your choice.",
    )
    capacity: _Size = Field(
        description="Card memory, e.g. 24GiB (for device: cpu the host memory this emulated card stands for)."
    )
    device: CardDevice = Field(
        CardDevice.CUDA, description="cuda (a real GPU) or cpu (an emulated card on host memory)."
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="Labels of the card's node, matched by models' placement.node_label."
    )

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not re.fullmatch(CARD_ID_PATTERN, value):
            raise ValueError(
                f"card id '{value}' is not allowed; use lower-case letters, digits, '-' or '_' (max 63 chars)"
            )
        return value

    @field_validator("capacity")
    @classmethod
    def _capacity(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"capacity {value} is not positive; write the card's memory, e.g. 24GiB")
        return value


def _check_cards(cards: list[CardSpec]) -> list[CardSpec]:
    if not cards:
        raise ValueError(
            "gpus is an empty list; list at least one card, write gpus: auto, or remove gpus to use the gpu section"
        )
    seen: dict[str, int] = {}
    slots: dict[tuple[str, int], str] = {}
    for i, card in enumerate(cards):
        if card.id in seen:
            raise ValueError(f"gpus[{i}].id '{card.id}' repeats gpus[{seen[card.id]}]; give each card its own id")
        seen[card.id] = i
        slot = (card.node, card.index)
        if slot in slots:
            raise ValueError(
                f"gpus[{i}] ({card.id}) and card {slots[slot]} are both index {card.index} on node {card.node}; "
                "give each card of a node its own index"
            )
        slots[slot] = card.id
    return cards


def _auto_only(value: str) -> str:
    if value != "auto":
        raise ValueError(
            f"'{value}' is not a gpus form; write gpus: auto, or list the cards (- {{id, node, index, capacity, device}})"
        )
    return value


# The gpus: section: "auto" or a list of cards (None: the gpu section's one card). The
# discriminator picks the branch from the value, so an error names that branch only
# (an error's path reads gpus.<i>.<field>: gpubroker.quotas.config_errors drops the tag).
GpusSection = Annotated[
    Annotated[str, AfterValidator(_auto_only), Tag("auto")]
    | Annotated[list[CardSpec], AfterValidator(_check_cards), Tag("cards")],
    Discriminator(lambda v: "auto" if isinstance(v, str) else "cards"),
]


class PlacementSpec(_Strict):
    cards: Literal["any"] | list[str] = Field(
        "any", description="Cards this model may run on: any, or a list of card ids from gpus."
    )
    node_label: dict[str, str] = Field(
        default_factory=dict, description="Only cards whose node has all these labels (e.g. {zone: east})."
    )
    spread: bool = Field(
        True,
        description="Put replicas on different cards (different nodes first) while they fit; each card a model is on "
        "holds its own base quota. false: keep the replicas together on one card.",
    )

    @model_validator(mode="after")
    def _cards(self) -> PlacementSpec:
        if isinstance(self.cards, list):
            if not self.cards:
                raise ValueError("placement.cards is an empty list; write any or list card ids")
            dupes = sorted({c for c in self.cards if self.cards.count(c) > 1})
            if dupes:
                raise ValueError(f"placement.cards repeats {', '.join(dupes)}; list each card once")
        return self


# ------------------------------------------------------------------------------ resolved cards
@dataclass(frozen=True)
class Card:
    """One card of the fleet, resolved (from the config or from discovery)."""

    id: str  # unique in the fleet; the Ray resource is gpubroker_card_<id>
    node: str  # logical node name (label gpubroker.io/node, node name/IP, or node id)
    index: int  # CUDA ordinal on the node (an ordinal for emulated cards)
    device: CardDevice  # cuda or cpu (emulated)
    capacity_bytes: int  # card memory (host memory it stands for when emulated)
    labels: tuple[tuple[str, str], ...] = ()  # the node's labels, sorted
    node_id: str | None = None  # Ray node id when discovered; None from the config
    emulated: bool = field(init=False)  # device is cpu

    def __post_init__(self) -> None:
        object.__setattr__(self, "emulated", self.device == CardDevice.CPU)

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)

    def matches(self, node_label: dict[str, str]) -> bool:
        mine = self.label_map
        return all(mine.get(k) == v for k, v in node_label.items())

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "node": self.node,
            "index": self.index,
            "device": str(self.device),
            "capacity_bytes": self.capacity_bytes,
            "labels": self.label_map,
            "node_id": self.node_id,
        }


def card_from_spec(spec: CardSpec) -> Card:
    return Card(
        id=spec.id,
        node=spec.node,
        index=spec.index,
        device=spec.device,
        capacity_bytes=int(spec.capacity),
        labels=tuple(sorted(spec.labels.items())),
    )


@dataclass(frozen=True)
class CardBudget:
    """What every card shares (the gpu section): the reserve and the per-process context cost."""

    reserve_frac: float  # share of capacity never granted
    context_bytes_per_process: int  # CUDA context per replica process (0 on emulated cards)

    def usable_bytes(self, card: Card, processes: int) -> int:
        """capacity x (1 - reserve_frac) - context per process on the card, never below 0 (as GpuSection)."""
        context = 0 if card.emulated else self.context_bytes_per_process * processes
        return max(0, int(card.capacity_bytes * (1.0 - self.reserve_frac)) - context)


def budget_from_gpu(gpu: Any, default_context_bytes: int) -> CardBudget:
    """The CardBudget of a config's gpu section (``gpubroker.quotas.config.GpuSection``)."""
    per = gpu.context_overhead
    per_process = default_context_bytes if per == "auto" else int(per)
    return CardBudget(reserve_frac=float(gpu.reserve_frac), context_bytes_per_process=per_process)


def single_card(gpu: Any, capacity_bytes: int | None = None) -> Card:
    """The one card a fleet without gpus: has (today's gpu section)."""
    capacity = capacity_bytes if capacity_bytes is not None else gpu.capacity_bytes
    if capacity is None:
        raise ValueError(
            "gpu.capacity is 'auto' and no measured capacity was given; pass capacity_bytes or set gpu.capacity"
        )
    device = CardDevice.CUDA if str(gpu.device).startswith("cuda") else CardDevice.CPU
    index = int(str(gpu.device).split(":", 1)[1]) if str(gpu.device).startswith("cuda:") else 0
    return Card(id=SINGLE_CARD_ID, node=SINGLE_CARD_NODE, index=index, device=device, capacity_bytes=int(capacity))


def fleet_cards(
    gpu: Any, gpus: Any, discovered: tuple[Card, ...] | None = None, capacity_bytes: int | None = None
) -> tuple[Card, ...]:
    """The fleet's cards: the gpus list, the discovered cards for gpus: auto, or the gpu section's one card."""
    if gpus is None:
        return (single_card(gpu, capacity_bytes),)
    if gpus == "auto":
        if discovered is None:
            raise ValueError(
                "gpus is 'auto' and no discovered cards were given; run gpubroker.deployments.cluster.discovery.discover_cards() "
                "on the cluster, or list the cards under gpus:"
            )
        if not discovered:
            raise ValueError(
                "gpus is 'auto' but the Ray cluster has no GPU; list emulated cards (device: cpu) under gpus:"
            )
        return tuple(discovered)
    return tuple(card_from_spec(spec) for spec in gpus)
