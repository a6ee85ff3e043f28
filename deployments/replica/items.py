"""What a replica's requests carry through Serve's batcher, and its error answers."""

from __future__ import annotations

from typing import Any


class Item:
    """One input on its way through Serve's batcher."""

    __slots__ = ("value", "cost", "owner", "let_in", "req")

    def __init__(self, value: Any, cost: int, owner: Any):
        self.value = value
        self.cost = cost
        self.owner = owner
        self.let_in = False  # counted in the replica's let-in-not-running cost (lazy gate)
        self.req: Any = (
            None  # its request at the gate (gpubroker.deployments.replica.shed.HeldRequest), set by the replica
        )


def batch_cost(items: list) -> int:
    """``batch_size_fn`` for token-priced models: the batch's total cost.

    An item costlier than the whole cap counts as the cap, so it runs alone instead of being
    refused by Serve's batcher ("Size of item is greater than max_batch_size").
    """
    return sum(min(item.cost, max(1, item.owner.cap)) for item in items)


def error(status: int, detail: str, **extra: Any) -> dict[str, Any]:
    return {"status": status, "detail": detail, **extra}
