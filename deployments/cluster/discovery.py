"""``gpus: auto``: every GPU of every node of the Ray cluster, as ``gpubroker.quotas.cards.Card``.

Ray says how many GPUs a node has (its ``GPU`` resource in ``ray.nodes()``) and what the node
is called (its ``gpubroker.io/node`` label, else its node name); NVML on that node says how
much memory each card has (a small task pinned to the node by its ``ray.io/node-id`` label
reads ``gpubroker.broker.capacity.nvml_total_bytes(i)``). A node without NVML cannot say its capacity:
``DiscoveryError`` names it, and the fix is to list its cards under ``gpus:``.

Discovered cards carry their Ray node id; their replicas are pinned to the node by that label
(``gpubroker.deployments.serve.placement_resources``), since a running node cannot declare new custom
resources. ``card_nodes`` answers the other way round for listed cards: which Ray node
holds each card's ``gpubroker_card_<id>`` resource.

Ray is imported inside the functions; ``nodes`` and ``capacity_probe`` can be injected.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpubroker.deployments.serve.placement_resources import CARD_RESOURCE_PREFIX, NODE_LABEL, RAY_NODE_ID_LABEL
from gpubroker.quotas.cards import Card, CardDevice

RAY_LABEL_PREFIX = "ray.io/"


class DiscoveryError(RuntimeError):
    """The cluster's cards cannot be found; the message names the node and the fix."""


def node_name(node: Mapping[str, Any]) -> str:
    """A node's logical name: its gpubroker.io/node label, else its node name, else its IP."""
    labels = node.get("Labels") or {}
    return str(labels.get(NODE_LABEL) or node.get("NodeName") or node.get("NodeManagerAddress") or node["NodeID"][:12])


def _card_id(node: str, index: int) -> str:
    slug = re.sub(r"[^a-z0-9_-]+", "-", node.lower()).strip("-_") or "node"
    return f"{slug[:50]}-gpu{index}"


def _nvml_totals(node_id: str, count: int) -> list[int]:
    """Card memory per GPU index on one node, read there by NVML (a task pinned by label)."""
    import ray

    @ray.remote(num_cpus=0, label_selector={RAY_NODE_ID_LABEL: node_id})
    def read(n: int) -> list[int]:
        from gpubroker.broker.capacity import nvml_total_bytes

        return [nvml_total_bytes(i) for i in range(n)]

    return list(ray.get(read.remote(count), timeout=60))  # type: ignore[arg-type]  # Ray types ObjectRef invariant


def discover_cards(
    nodes: Iterable[Mapping[str, Any]] | None = None, capacity_probe: Callable[[str, int], list[int]] | None = None
) -> tuple[Card, ...]:
    """Every GPU of every alive node, ordered by node name then index."""
    if nodes is None:
        import ray

        nodes = ray.nodes()
    probe = capacity_probe or _nvml_totals
    cards: list[Card] = []
    names: dict[str, str] = {}
    for node in nodes:
        if not node.get("Alive", True):
            continue
        count = int((node.get("Resources") or {}).get("GPU", 0))
        if count <= 0:
            continue
        name, node_id = node_name(node), str(node["NodeID"])
        if name in names:
            raise DiscoveryError(
                f"nodes {names[name][:12]} and {node_id[:12]} are both called '{name}'; "
                f"start them with distinct --labels {NODE_LABEL}=<name>"
            )
        names[name] = node_id
        try:
            totals = probe(node_id, count)
        except Exception as exc:  # noqa: BLE001 - any failure there means: no capacity known
            raise DiscoveryError(
                f"node {name} ({node_id[:12]}) has {count} GPU(s) but NVML could not read their memory "
                f"({exc}); list its cards under gpus: with a capacity each"
            ) from None
        if len(totals) != count:
            raise DiscoveryError(
                f"node {name} has {count} GPU(s) in Ray but NVML read {len(totals)}; list its cards under gpus:"
            )
        labels = tuple(
            sorted(
                (str(k), str(v))
                for k, v in (node.get("Labels") or {}).items()
                if not str(k).startswith(RAY_LABEL_PREFIX) and k != NODE_LABEL
            )
        )
        cards.extend(
            Card(_card_id(name, i), name, i, CardDevice.CUDA, int(total), labels, node_id)
            for i, total in enumerate(totals)
        )
    return tuple(sorted(cards, key=lambda c: (c.node, c.index)))


def card_nodes(nodes: Iterable[Mapping[str, Any]] | None = None) -> dict[str, str]:
    """card id -> Ray node id of the alive node declaring its ``gpubroker_card_<id>`` resource."""
    if nodes is None:
        import ray

        nodes = ray.nodes()
    out: dict[str, str] = {}
    for node in nodes:
        if not node.get("Alive", True):
            continue
        for resource in node.get("Resources") or {}:
            if resource.startswith(CARD_RESOURCE_PREFIX):
                out[resource[len(CARD_RESOURCE_PREFIX) :]] = str(node["NodeID"])
    return out


def missing_cards(listed: Iterable[Any], nodes: Iterable[Mapping[str, Any]] | None = None) -> list[Any]:
    """The listed cards (``gpubroker.quotas.cards.CardSpec``: id, node) whose ``gpubroker_card_<id>``
    resource no alive node of the cluster declares, in the config's order."""
    declared = card_nodes(nodes)
    return [card for card in listed if card.id not in declared]


def missing_cards_fix(missing: Iterable[Any], address: str) -> str:
    """How to start the nodes so the cards ``missing`` are declared: one ``ray start`` per node."""
    by_node: dict[str, list[str]] = {}
    for card in missing:
        by_node.setdefault(card.node, []).append(card.id)
    lines = []
    for node, ids in by_node.items():
        res = ", ".join(f'"{CARD_RESOURCE_PREFIX}{i}": 1000' for i in ids)
        lines.append(f"ray start --address {address} --resources '{{{res}}}' --labels {NODE_LABEL}={node}")
    return "; ".join(lines)
