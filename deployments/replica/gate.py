"""The admission gate for lazy batch formation: a pure state machine with an injected clock.

Ray 2.60's ``@serve.batch`` forms batches eagerly: while a long batch runs, arrivals leave in small
batches that each pay the fixed cost. The gate holds requests while every batch slot is busy and,
when a batch ends, lets up to one cap's worth into the batcher in one event-loop turn, so batches
grow with the load. A request enters only a batch still forming (else formed batches queue for
good), and the owner must ``settle`` a cancelled request (else ``released`` never returns to zero).
The replica maps tokens to futures, the simulator to request ids; both run this same code.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


@dataclass
class LazyGate(Generic[T]):
    """FIFO gate in front of an eager batcher. Not thread-safe: one event loop drives it."""

    max_concurrent_batches: int = 1
    cap: int = 1  # batch cap in cost units (the replica's local cap)
    wait_s: float = 0.0  # the broker's batch wait timeout: the forming batch's window
    clock: Callable[[], float] = time.monotonic
    running: int = 0  # batches executing
    released: int = 0  # cost let into the batcher and not running yet (the forming batch)
    form_until: float = 0.0  # clock time at which the forming batch's wait window ends
    held: deque[tuple[T, int]] = field(default_factory=deque)  # (token, cost) waiting, oldest first

    def is_open(self, cost: int) -> bool:
        """May a request of ``cost`` enter the batcher now (nobody held before it)?"""
        if self.held or self.running >= self.max_concurrent_batches:
            return False
        if self.released == 0:
            return True
        return self.clock() < self.form_until and self.released + cost <= self.cap

    def admit(self, token: T, cost: int) -> bool:
        """Let ``token`` in now (True) or hold it until ``pump`` releases it (False)."""
        if self.is_open(cost):
            self._let_in(cost)
            return True
        self.held.append((token, int(cost)))
        return False

    def _let_in(self, cost: int) -> None:
        if self.released == 0:  # the first request of a new batch opens its wait window
            self.form_until = self.clock() + max(0.0, self.wait_s)
        self.released += int(cost)

    def settle(self, cost: int) -> None:
        """A let-in request left the batcher's queue: it runs now, or it was cancelled."""
        self.released = max(0, self.released - int(cost))

    def batch_started(self) -> None:
        self.running += 1

    def batch_ended(self) -> None:
        self.running = max(0, self.running - 1)

    def pump(self, alive: Callable[[T], bool] = lambda _t: True) -> list[T]:
        """A slot is free and nothing let in is pending: release held tokens, oldest first, up
        to one cap's worth (the first one whatever its cost). Tokens that are no longer
        ``alive`` (timed out while held) are dropped. Returns the released tokens, in order."""
        out: list[T] = []
        if self.running >= self.max_concurrent_batches or self.released > 0:
            return out
        while self.held:
            token, cost = self.held[0]
            if not alive(token):
                self.held.popleft()
                continue
            if self.released > 0 and self.released + cost > self.cap:
                break
            self.held.popleft()
            self._let_in(cost)
            out.append(token)
        return out

    def drop(self, token: T) -> bool:
        """Remove a held token (its request was cancelled before release)."""
        for k, (tok, _cost) in enumerate(self.held):
            if tok == token:
                del self.held[k]
                return True
        return False
