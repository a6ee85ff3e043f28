"""Shedding requests that can no longer answer within their SLO (``models.<name>.shed_late``).

Under an overload that outlasts the queue a FIFO replica answers every request late and its goodput
falls towards zero. So a request held at the lazy gate enters a batch only if its wait so far plus
the last batch time (for each batch its held items still need) fits ``slo_p95_ms``; else it is
answered 504 at once, naming its wait, the batch time and the SLO, and its other items are
cancelled. Shed requests count as timeouts, and apart in ``shed``. ``LateShed`` is pure and runs in
the replica and the simulator; ``wait_items`` is the replica's asyncio glue.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class LateShed:
    """Per replica: the SLO and the last batch's run time."""

    slo_s: float
    last_batch_s: float = 0.0  # the replica's last batch that ran, start to end (0 before the first)

    def too_late(self, waited_s: float, batches: int = 1) -> bool:
        """Would a request that has waited ``waited_s`` answer after the SLO if its first batch
        began now and it needs ``batches`` of them (a request of more items than one cap)?"""
        return waited_s + batches * self.last_batch_s > self.slo_s

    def check(self, model: str, req: HeldRequest, now_s: float, cap: int) -> Late | None:
        """The verdict on a request whose item is next to leave the gate: ``Late`` (then for all
        of its items still held) or None. Its items still held need ceil(cost / cap) batches, and
        no more than one each (an item costlier than the cap runs alone, ``gpubroker.deployments.replica.items``)."""
        if req.late is None:
            waited = now_s - req.t_in
            batches = max(1, min(req.held_items, -(-req.held_cost // max(1, cap))))
            if self.too_late(waited, batches):
                req.late = Late(self.detail(model, waited, batches))
        return req.late

    def batch_ran(self, seconds: float) -> None:
        self.last_batch_s = max(0.0, float(seconds))

    def detail(self, model: str, waited_s: float, batches: int = 1) -> str:
        """The 504's text: what it waited, what its batch would take, the SLO, what to do."""
        its = "its batch" if batches == 1 else f"its {batches} batches"
        return (
            f"shed: waited {waited_s * 1000.0:.0f} ms in model '{model}'; with {its} (~"
            f"{self.last_batch_s * 1000.0:.0f} ms each) it would answer after slo_p95_ms "
            f"({self.slo_s * 1000.0:g} ms). The replica is overloaded: retry later, or set "
            "shed_late: false to be answered late instead"
        )


class HeldRequest:
    """One request's items at the replica: when it arrived (monotonic), the count and cost of its
    items not let in yet, and its verdict once one of them was found too late."""

    __slots__ = ("t_in", "held_items", "held_cost", "late")

    def __init__(self, t_in: float, costs: list[int]):
        self.t_in = t_in
        self.held_items = len(costs)
        self.held_cost = sum(costs)
        self.late: Late | None = None

    def let_in(self, cost: int) -> None:
        """One of its items left the gate for a batch."""
        self.held_items -= 1
        self.held_cost -= cost


class Late:
    """What a shed request's item resolves to instead of a model output."""

    __slots__ = ("detail",)

    def __init__(self, detail: str):
        self.detail = detail


async def wait_items(
    tasks: list[asyncio.Future], timeout_s: float, shedding: bool
) -> tuple[set[asyncio.Future], set[asyncio.Future], Late | None]:
    """``asyncio.wait(tasks, timeout=timeout_s)``; with ``shedding``, it returns at the first item
    that resolved to ``Late`` (the third value; the caller cancels what is still pending)."""
    if not shedding:
        finished, waiting = await asyncio.wait(tasks, timeout=timeout_s)
        return finished, waiting, None
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    done: set[asyncio.Future] = set()
    pending: set[asyncio.Future] = set(tasks)
    while pending:
        now_done, pending = await asyncio.wait(
            pending, timeout=max(0.0, end - loop.time()), return_when=asyncio.FIRST_COMPLETED
        )
        if not now_done:
            break  # the request's timeout
        done |= now_done
        for t in now_done:
            if not t.cancelled() and t.exception() is None and isinstance(t.result(), Late):
                return done, pending, t.result()
    return done, pending, None
