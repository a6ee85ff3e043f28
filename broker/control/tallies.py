"""Per-model report tallies over a window, for status only (attainment and cost in
``BrokerCore.status``; the policy reads the report window, ``gpubroker.broker.control.window``, instead)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Tally:
    """One report's contribution to status-only aggregates (attainment, cost)."""

    t_s: float
    completions: int
    misses: int  # rejections + timeouts + errors


class Tallies:
    """One model's report tallies over its window and their running sums: ``status`` reads the
    sums every tick (the metrics), so it must not add up a window of reports each time."""

    __slots__ = ("items", "completions", "misses")

    def __init__(self) -> None:
        self.items: deque[Tally] = deque()
        self.completions = 0
        self.misses = 0

    def add(self, tally: Tally) -> None:
        self.items.append(tally)
        self.completions += tally.completions
        self.misses += tally.misses

    def evict_older(self, now_s: float, window_s: float) -> None:
        """Drop the tallies older than ``window_s`` before ``now_s``."""
        items = self.items
        while items and now_s - items[0].t_s > window_s:
            gone = items.popleft()
            self.completions -= gone.completions
            self.misses -= gone.misses
