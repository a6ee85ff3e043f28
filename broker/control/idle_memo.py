"""Idle models decided once (``broker.control.policy.decide``): a cache that changes no answer.

In a fleet of many models most are idle at any time, and an idle model's per-model step (the
latency fit, the memory model, the batch rules, anti-oscillation, the guard-rails) gives the
same answer tick after tick while nothing it reads moves. The policy keeps that answer per
model, keyed on everything the step reads: the whole ``ModelLoad`` but its replicas' report
times (``replica_reports``: only the quota planner reads them, and it runs every tick), the
model's state, its grant before and after the quota plan, the reclaim flags, the profile's
slack and objective, and the few facts of the clock the step depends on (idle past
``idle_hold_s``, recovering from an emergency, the card's free share under the emergency bar).

The cache keeps only answers that do not move with the clock on their own: the ``idle`` rule,
the cap unchanged (no anti-oscillation timer is armed), no reversals or widened band to relax,
no spell that starts "now". Anything else is decided afresh every tick. ``decide(...,
memo=None)`` runs every step in full; a test runs the same ticks both ways and compares every
output (``tests/sim/test_idle_memo.py``).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from broker.control.memory_model import MemoryModel
from broker.control.state import BatchWant, ModelState
from broker.wire import ModelDecision, ModelLoad

_LOAD_KEY = attrgetter(*(f for f in ModelLoad.__dataclass_fields__ if f != "replica_reports"))


def load_key(load: ModelLoad) -> tuple[Any, ...]:
    """Every field of ``load`` a model's step reads (all but the report times)."""
    return _LOAD_KEY(load)


class Entry:
    """One model's cached step: its key, what the first pass gave, what the second gave."""

    __slots__ = ("after", "config", "final", "key", "mm", "ms", "spec", "want")

    def __init__(self, config: Any, spec: Any, key: tuple[Any, ...], want: BatchWant, ms: ModelState, mm: MemoryModel):
        self.config, self.spec, self.key = config, spec, key
        self.want, self.ms, self.mm = want, ms, mm
        # the second pass (guard-rails, version, decision) for one (grant, flags) key
        self.after: tuple[Any, ...] | None = None
        self.final: tuple[ModelDecision, ModelState] | None = None


class IdleMemo:
    """Per model, the last idle step that can be reused (``broker.control.policy.decide``)."""

    __slots__ = ("entries", "hits")

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.hits = 0  # steps reused (for the benchmark's table; no answer depends on it)

    def get(self, name: str, config: Any, spec: Any, key: tuple[Any, ...]) -> Entry | None:
        entry = self.entries.get(name)
        if entry is None or entry.config is not config or entry.spec is not spec or entry.key != key:
            return None
        self.hits += 1
        return entry

    def put(self, name: str, entry: Entry | None) -> None:
        if entry is None:
            self.entries.pop(name, None)
        else:
            self.entries[name] = entry


def steady(old: ModelState) -> bool:
    """No timer of the model's own state runs: no reversal to prune, no band to relax, admitting,
    and an idle spell already begun (its start is a time already in the state)."""
    return not old.reversals and old.band_scale <= 1.0 and old.paused_since_s is None and old.last_arrival_s is not None


__all__ = ["Entry", "IdleMemo", "load_key", "steady"]
