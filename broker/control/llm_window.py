"""LLM engines' reports over a window, and what status says of an engine.

An LLM replica sends the usual ``StatsReport`` with its engine's report in ``engine`` and gets its
bounds back in ``ModelSettings.engine``; the broker never calls the engine. ``EngineWindow`` keeps
reports for ``window_s`` (tokens/s from the cumulative counters); the first live replica stands for
the model, and ``views`` puts each engine's latest report in the tick's snapshot, where the LLM kind
(``gpubroker.broker.control.kind_llm``) runs its rules. ``engine_status`` is the engine part of a
model's status.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gpubroker.broker.control.llm_rules import EngineRecord
from gpubroker.broker.control.types import EngineView
from gpubroker.broker.wire import EngineReport, EngineStatus
from gpubroker.quotas.config import ModelSpec


@dataclass(frozen=True)
class EngineSeen:
    received_s: float  # broker time the report arrived
    replica_id: str
    report: EngineReport  # gpubroker.deployments.llm.server.engine_report


class EngineWindow:
    """Engine reports per model and replica over ``window_s`` (mechanism: the broker core keeps it)."""

    def __init__(self, window_s: float = 30.0, stale_after_s: float = 10.0) -> None:
        self.window_s = float(window_s)
        self.stale_after_s = float(stale_after_s)
        self._seen: dict[str, dict[str, deque[EngineSeen]]] = {}

    def add(self, model: str, replica_id: str, report: EngineReport, received_s: float) -> None:
        events = self._seen.setdefault(model, {}).setdefault(replica_id, deque())
        events.append(EngineSeen(received_s, replica_id, report))
        while events and events[0].received_s < received_s - self.window_s:
            events.popleft()

    def views(self, models: tuple[str, ...], now_s: float) -> dict[str, EngineView]:
        """Each of ``models`` with a live report: its first live replica's latest, and how many report."""
        out = {}
        for name in models:
            live = self.live(name, now_s)
            if live:
                out[name] = EngineView(live[0][-1].report, len(live))
        return out

    def forget(self, models: set[str]) -> None:
        for name in list(self._seen):
            if name not in models:
                del self._seen[name]

    def live(self, model: str, now_s: float) -> list[deque[EngineSeen]]:
        reps = self._seen.get(model, {})
        return [reps[r] for r in sorted(reps) if reps[r] and now_s - reps[r][-1].received_s <= self.stale_after_s]

    def latest(self, model: str, now_s: float) -> EngineSeen | None:
        live = self.live(model, now_s)
        return live[0][-1] if live else None

    def rates(self, model: str, now_s: float) -> dict[str, float]:
        """Prompt and generated tokens per second over the window, summed over live replicas."""
        out = {"tokens_in_per_s": 0.0, "tokens_out_per_s": 0.0}
        for events in self.live(model, now_s):
            first, last = events[0], events[-1]
            span = last.received_s - first.received_s
            if span <= 0:
                continue
            for key, counter in (("tokens_in_per_s", "tokens_in"), ("tokens_out_per_s", "tokens_out")):
                out[key] += max(0, int(getattr(last.report, counter)) - int(getattr(first.report, counter))) / span
        return out


def engine_status(
    window: EngineWindow, name: str, spec: ModelSpec, record: EngineRecord | None, now_s: float
) -> EngineStatus:
    """The engine part of a model's status: bounds as set, what the engine reports (None before its
    first report), the SLOs."""
    assert spec.llm is not None  # a kind: llm model's config has its llm section
    seen, d = window.latest(name, now_s), None if record is None else record.decision
    rep = seen.report if seen else None
    rates = window.rates(name, now_s)
    out: EngineStatus = {
        "running": None if rep is None else rep.running,
        "waiting": None if rep is None else rep.waiting,
        "kv_blocks_total": None if rep is None else rep.kv_blocks_total,
        "kv_blocks_used": None if rep is None else rep.kv_blocks_used,
        "kv_blocks_free": None if rep is None else rep.kv_blocks_free,
        "kv_blocks_reserved": None if rep is None else rep.kv_blocks_reserved,
        "kv_cache_bytes": None if rep is None else rep.kv_cache_bytes,
        "preemptions": None if rep is None else rep.preemptions,
        "ttft_p50_ms": None if rep is None else rep.ttft_p50_ms,
        "ttft_p95_ms": None if rep is None else rep.ttft_p95_ms,
        "ttft_p99_ms": None if rep is None else rep.ttft_p99_ms,
        "tpot_p50_ms": None if rep is None else rep.tpot_p50_ms,
        "tpot_p95_ms": None if rep is None else rep.tpot_p95_ms,
        "tpot_p99_ms": None if rep is None else rep.tpot_p99_ms,
        "samples": None if rep is None else rep.samples,
        "tokens_in_per_s": rates["tokens_in_per_s"],
        "tokens_out_per_s": rates["tokens_out_per_s"],
        "ttft_slo_ms": spec.llm.ttft_slo_ms,
        "tpot_slo_ms": spec.llm.tpot_slo_ms,
        "reporting": seen is not None,
        "running_bounds": {
            "max_num_seqs": None if rep is None else rep.max_num_seqs,
            "max_batched_tokens": None if rep is None else rep.max_batched_tokens,
            "prefill_paused": None if rep is None else rep.prefill_paused,
        },
    }
    if d is not None:
        out.update(
            EngineStatus(
                max_num_seqs=d.max_num_seqs,
                max_batched_tokens=d.max_batched_tokens,
                kv_blocks=d.kv_blocks,
                prefill_paused=d.prefill_paused,
                rule=str(d.rule),
                reason=d.reason,
                want_grant_bytes=d.want_grant_bytes,
                kv_cache_target_bytes=d.kv_cache_bytes,
            )
        )
    return out
