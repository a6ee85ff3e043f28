"""Cheap per-request work on the event loop, costly work in a thread: decided from measured time.

Validation runs off the event loop so a slow validator never stalls admission, but for most models
the thread hop costs more than the work. ``InlineOrThread`` starts in a thread, runs inline after
``warm`` runs in a row under ``inline_below_ms``, and goes back to the thread for ``cooldown`` runs
after one inline run over ``back_above_ms``. ``observe``/``inline`` are pure; ``run`` times the work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class InlineOrThread:
    inline_below_ms: float = 0.2  # a run this quick costs less than the hop to a thread
    back_above_ms: float = 1.0  # an inline run this slow blocked the loop: back to the thread
    warm: int = 16  # quick runs in a row, in the thread, before going inline
    cooldown: int = 512  # runs in the thread after falling back, before measuring again
    inline_now: bool = False
    quick_runs: int = 0  # consecutive quick runs measured in the thread
    cooling: int = 0  # thread runs left before quick runs count again
    fallbacks: int = 0  # times an inline run was too slow

    def inline(self) -> bool:
        return self.inline_now

    def observe(self, ms: float, inline: bool) -> None:
        """One run took ``ms`` (inline on the loop, or in the thread)."""
        if inline:
            if ms > self.back_above_ms:
                self.inline_now, self.quick_runs, self.cooling = False, 0, self.cooldown
                self.fallbacks += 1
            return
        if self.cooling > 0:
            self.cooling -= 1
            return
        self.quick_runs = self.quick_runs + 1 if ms < self.inline_below_ms else 0
        if self.quick_runs >= self.warm:
            self.inline_now = True

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.inline_now:
            t0 = time.perf_counter()
            out = fn(*args)
            self.observe((time.perf_counter() - t0) * 1000.0, True)
            return out
        out, ms = await asyncio.to_thread(_timed, fn, *args)
        self.observe(ms, False)
        return out


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - t0) * 1000.0
