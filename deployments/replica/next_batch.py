"""With the lazy gate, a finished batch lets the next one start before its results are sent.

Found live (``bench.knee_breakdown``): each result of a batch is a response the replica's event
loop sends (the request's coroutine resumes, Serve wraps the answer, Ray ships it to the proxy).
Serve's batcher sets a batch's results as soon as the batch function returns, and the next
batch, formed by the gate's ``pump`` in that same turn, ran only after those sends had taken
their turns on the loop: the model sat idle between batches for a time that grows with the
batch (tens of ms at ~20 requests a batch on 2 loaded cores). Here the finishing batch waits,
a bounded moment, until the next batch has started, and only then returns its results. Serve's
batcher gets one slot more than the gate (``extra_slots``), so the next batch is not held
behind the finishing one's semaphore; the gate still lets at most its own number run. A replica
class with ``START_NEXT_FIRST = False`` keeps the old order (``bench.knee_breakdown`` compares them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class NextBatchStart:
    """The replica's "next batch first" switch. Drives one asyncio event; one event loop."""

    def __init__(self, enabled: bool, wait_s: float = 0.01):
        self.enabled = bool(enabled)
        self.wait_s = float(wait_s)  # the most a batch's results wait for the next one to start
        self._started = asyncio.Event()

    @property
    def extra_slots(self) -> int:
        """Slots Serve's batcher gets beyond the gate's ``max_concurrent_batches``."""
        return int(self.enabled)

    def batch_started(self, gate: Any) -> None:
        gate.batch_started()
        self._started.set()

    async def pump(self, pump: Callable[[], Any], gate: Any) -> None:
        """``pump()`` the gate; if it let requests in, wait until their batch has started."""
        self._started.clear()
        pump()
        if not (self.enabled and gate.released > 0):
            return
        try:
            await asyncio.wait_for(self._started.wait(), self.wait_s)
        except TimeoutError:
            pass
