"""Decision-log entries: pure builders for what the broker logs of each settings change."""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, TypedDict, cast

from gpubroker.broker.control.types import LogLine, ModelDecision, ModelLoad
from gpubroker.broker.control.vocab import EntryKind
from gpubroker.broker.wire import DecisionRecord, ModelSettings

logger = logging.getLogger("gpubroker.broker")


class DecisionLog:
    """The bounded, numbered decision log. One per broker; the cores of several cards share it,
    so ``seq`` orders every decision of the fleet."""

    def __init__(self, maxlen: int) -> None:
        self.entries: deque[DecisionRecord] = deque(maxlen=maxlen)
        self.seq = 0

    def append(self, entry: DecisionRecord, line: str) -> DecisionRecord:
        """``entry``: built by a kind's own builder, every key but ``seq``, which the log numbers."""
        self.seq += 1
        record = cast(DecisionRecord, {"seq": self.seq, **entry})
        self.entries.append(record)
        logger.info("decision #%d %s", self.seq, line)
        return record

    def resize(self, maxlen: int) -> None:
        if maxlen != self.entries.maxlen:
            self.entries = deque(self.entries, maxlen=maxlen)

    def restore(self, entries: list[DecisionRecord], seq: int) -> None:
        known = {e["seq"] for e in self.entries}
        for e in entries:
            if e.get("seq") not in known:
                self.entries.append(e)
        self.entries = deque(sorted(self.entries, key=lambda e: e["seq"]), maxlen=self.entries.maxlen)
        self.seq = max(self.seq, int(seq))

    def since(self, model: str | None = None, since_seq: int = 0) -> list[DecisionRecord]:
        """Entries after ``since_seq`` (oldest first): read from the newest end, since entries are
        kept in sequence order, so a caller polling for new ones does not walk the whole log."""
        out = []
        for e in reversed(self.entries):
            if e["seq"] <= since_seq:
                break
            if model is None or e.get("model") == model:
                out.append(e)
        out.reverse()
        return out


def finite(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class SettingsView(TypedDict):
    """A settings entry's ``old`` and ``new``: what the decision log shows of a model's settings."""

    max_batch_size: int
    batch_wait_timeout_s: float  # rounded to the microsecond
    grant_bytes: int
    admit: bool


def settings_view(s: ModelSettings | ModelDecision) -> SettingsView:
    """What a settings entry shows of a model's settings (a decision's or the replicas'), the wait rounded."""
    return {
        "max_batch_size": s.max_batch_size,
        "batch_wait_timeout_s": round(s.batch_wait_timeout_s, 6),
        "grant_bytes": s.grant_bytes,
        "admit": s.admit,
    }


def settings_entry(
    now: float, name: str, old: ModelSettings, new: ModelSettings, md: ModelDecision, load: ModelLoad | None, dry: bool
) -> LogLine:
    """One settings change for the decision log: the entry (inputs, old, new, trigger) and its log line."""
    inputs: dict[str, Any] = {}
    if load is not None:
        inputs = {
            "queue_depth": load.queue_depth,
            "arrival_rate_rps": round(load.arrival_rate_rps, 3),
            "p95_ms": None if load.p95_ms is None else round(load.p95_ms, 2),
            "busy_frac": round(load.busy_frac, 3),
            "mem_used_bytes": load.mem_used_bytes,
            "replicas": load.replicas,
        }
    was, will = dict(settings_view(old)), dict(settings_view(new))
    entry: DecisionRecord = {
        "kind": EntryKind.SETTINGS,
        "time_s": now,
        "model": name,
        "trigger": md.trigger,
        "rule": md.rule,  # the batch rule that answered (docs/RULES.md)
        "trigger_value": finite(md.trigger_value),
        "reason": md.reason,
        "inputs": inputs,
        "old": was,
        "new": will,
        "dry_run": dry,
    }
    diff = ", ".join(f"{k} {was[k]}->{will[k]}" for k in will if was[k] != will[k])
    return entry, (
        f"{name}: {diff or 'no change'} [{md.trigger}={entry['trigger_value']}] {md.reason}"
        + (" (dry run)" if dry else "")
    )
