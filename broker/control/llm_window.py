"""LLM engines inside the broker core: their reports over a window, the rules per engine, the bounds in the reply.

An LLM replica sends the usual ``StatsReport`` with its engine's report in ``engine`` and gets its
bounds back in ``ModelSettings.engine``; the broker never calls the engine. Each tick, after the
fleet policy has moved the ledger, ``LlmControl.step`` runs ``llm_rules.decide_llm`` for every
engine with a fresh report, under its grant, and its ``want_grant_bytes`` is the lending need (the
batch rules never run on these models). ``EngineWindow`` keeps reports for ``window_s`` (tokens/s
from the cumulative counters); the first live replica stands for the model. Pure.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from gpubroker.broker.control.llm_rules import (
    LlmDecision,
    LlmRule,
    LlmState,
    LlmTrigger,
    decide_llm,
    load_from_report,
    rule_config_for,
)
from gpubroker.broker.control.vocab import EntryKind
from gpubroker.broker.wire import EngineBounds, ModelSettings, StatsReport
from gpubroker.quotas.config import FleetConfig
from gpubroker.quotas.sizes import format_size

ENGINE_KEYS = ("max_num_seqs", "max_batched_tokens", "kv_blocks", "prefill_paused")  # what ModelSettings.engine carries


@dataclass(frozen=True)
class EngineSeen:
    received_s: float  # broker time the report arrived
    replica_id: str
    report: Mapping[str, Any]  # gpubroker.deployments.llm.server.engine_report


class EngineWindow:
    """Engine reports per model and replica over ``window_s``."""

    def __init__(self, window_s: float = 30.0, stale_after_s: float = 10.0) -> None:
        self.window_s = float(window_s)
        self.stale_after_s = float(stale_after_s)
        self._seen: dict[str, dict[str, deque[EngineSeen]]] = {}

    def add(self, model: str, replica_id: str, report: Mapping[str, Any], received_s: float) -> None:
        events = self._seen.setdefault(model, {}).setdefault(replica_id, deque())
        events.append(EngineSeen(received_s, replica_id, dict(report)))
        while events and events[0].received_s < received_s - self.window_s:
            events.popleft()

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
                out[key] += max(0, int(last.report.get(counter, 0)) - int(first.report.get(counter, 0))) / span
        return out


def _state_to_dict(s: LlmState) -> dict[str, Any]:
    d = asdict(s)
    d["last_change_s"] = None if not math.isfinite(s.last_change_s) else s.last_change_s
    return d


def _state_from_dict(d: Mapping[str, Any]) -> LlmState:
    d = dict(d)
    d["last_change_s"] = float("-inf") if d.get("last_change_s") is None else float(d["last_change_s"])
    return LlmState(**{k: v for k, v in d.items() if k in LlmState.__dataclass_fields__})


def engine_settings(d: LlmDecision) -> EngineBounds:
    """The bounds a decision sets, as ``ModelSettings.engine`` carries them."""
    return EngineBounds(d.max_num_seqs, d.max_batched_tokens, d.kv_blocks, d.prefill_paused, d.kv_cache_bytes)


def _view(s: LlmState | None) -> dict[str, Any] | None:
    return None if s is None else {k: getattr(s, k) for k in ENGINE_KEYS}


class LlmControl:
    """The broker core's LLM part: ``observe`` each report, ``step`` each tick."""

    def __init__(self, cfg: FleetConfig, stale_after_s: float = 10.0) -> None:
        self.window = EngineWindow(stale_after_s=stale_after_s)
        self._states: dict[str, LlmState] = {}
        self._decisions: dict[str, LlmDecision] = {}
        self._last_rule: dict[str, str] = {}
        self.reconfigure(cfg)

    @classmethod
    def carry(cls, old: LlmControl | None, cfg: FleetConfig, stale_after_s: float = 10.0) -> LlmControl:
        """The control for a (new) config, keeping what ``old`` learnt of the models still there."""
        if old is None:
            return cls(cfg, stale_after_s)
        old.reconfigure(cfg)
        return old

    def reconfigure(self, cfg: FleetConfig) -> None:
        self._cfg = cfg
        self.models = tuple(n for n, m in cfg.models.items() if m.kind == "llm")
        self.window.window_s = max(m.control.window_s for m in cfg.models.values()) if cfg.models else 30.0
        keep = set(self.models)
        self.window.forget(keep)
        for table in (self._states, self._decisions, self._last_rule):
            for name in [n for n in table if n not in keep]:
                del table[name]

    # ------------------------------------------------------------ reports in
    def observe(self, rep: StatsReport, now_s: float) -> None:
        if rep.model in self.models and rep.engine:
            self.window.add(rep.model, rep.replica_id, rep.engine, now_s)

    def need_bytes(self) -> dict[str, int]:
        """Per LLM: the grant its engine would use (the lending planner's need)."""
        return {n: d.want_grant_bytes for n, d in self._decisions.items()}

    # ------------------------------------------------------------ one tick
    def step(
        self,
        now_s: float,
        free_frac: float,
        grants: Mapping[str, int],
        dry_run: bool = False,
        incoming: Mapping[str, int] | None = None,
    ) -> list[tuple[dict[str, Any], str]]:
        """Run the rules for every engine with a fresh report; the decision-log entries of the changes.
        ``incoming``: per model, the grant on its way to it (transfers begun, not yet confirmed)."""
        out = []
        for name in self.models:
            seen = self.window.latest(name, now_s)
            if seen is None:
                continue
            spec = self._cfg.models[name]
            replicas = max(1, len(self.window.live(name, now_s)))
            report = seen.report
            cfg = rule_config_for(
                spec.llm.expected_peak_concurrency,
                spec.llm.ttft_slo_ms,
                spec.llm.tpot_slo_ms,
                report,
                base_bytes=int(report.get("weights_bytes", 0)),
                idle_hold_s=spec.control.idle_hold_s,
                lend_floor_bytes=int(spec.quota.min) // replicas,
            )
            grant = int(grants.get(name, spec.quota.base)) // replicas
            coming = int((incoming or {}).get(name, 0)) // replicas
            load = load_from_report(report, now_s, free_frac, grant, coming)
            old = self._states.get(name)
            decision, state = decide_llm(load, cfg, old)
            self._states[name], self._decisions[name] = state, decision
            rule_changed = self._last_rule.get(name) != decision.rule and decision.rule is not LlmRule.HOLD
            if decision.bounds_changed(old) or rule_changed:  # a change, or a new rule holding (a squeeze's pause)
                out.append(_entry(now_s, name, old, state, decision, _engine_inputs(load, grant), dry_run))
            self._last_rule[name] = decision.rule
        return out

    # ------------------------------------------------------------ reply, status, checkpoint
    def with_engine(self, s: ModelSettings) -> ModelSettings:
        """``s`` with its engine bounds (LLM models with a decision; others unchanged)."""
        d = self._decisions.get(s.model)
        return s if d is None else replace(s, engine=engine_settings(d))

    def status(self, name: str, now_s: float) -> dict[str, Any]:
        """The engine part of a model's status: bounds as set, what the engine reports, the SLOs."""
        if name not in self.models:
            return {}
        spec = self._cfg.models[name]
        seen, d = self.window.latest(name, now_s), self._decisions.get(name)
        rep = dict(seen.report) if seen else {}
        out: dict[str, Any] = {
            k: rep.get(k)
            for k in (
                "running",
                "waiting",
                "kv_blocks_total",
                "kv_blocks_used",
                "kv_blocks_free",
                "kv_blocks_reserved",
                "kv_cache_bytes",
                "preemptions",
                "ttft_p50_ms",
                "ttft_p95_ms",
                "ttft_p99_ms",
                "tpot_p50_ms",
                "tpot_p95_ms",
                "tpot_p99_ms",
                "samples",
            )
        }
        out.update(self.window.rates(name, now_s))
        out.update(
            ttft_slo_ms=spec.llm.ttft_slo_ms,
            tpot_slo_ms=spec.llm.tpot_slo_ms,
            reporting=seen is not None,
            running_bounds={k: rep.get(k) for k in ("max_num_seqs", "max_batched_tokens", "prefill_paused")},
        )
        if d is not None:
            out.update(
                {k: getattr(d, k) for k in ENGINE_KEYS},
                rule=str(d.rule),
                reason=d.reason,
                want_grant_bytes=d.want_grant_bytes,
                kv_cache_target_bytes=d.kv_cache_bytes,
            )
        return {"kind": "llm", "engine": out}

    def to_dict(self) -> dict[str, Any]:
        return {
            "states": {n: _state_to_dict(s) for n, s in self._states.items()},
            "decisions": {
                n: {**asdict(d), "value": d.value if math.isfinite(d.value) else None}
                for n, d in self._decisions.items()
            },
            "last_rule": dict(self._last_rule),
        }

    def load(self, data: Mapping[str, Any] | None) -> None:
        """Resume from ``to_dict`` (a checkpoint); models no longer LLMs are dropped."""
        data = data or {}
        self._states = {n: _state_from_dict(s) for n, s in data.get("states", {}).items() if n in self.models}
        self._decisions = {}
        for n, raw in data.get("decisions", {}).items():
            if n in self.models:
                raw = dict(
                    raw,
                    rule=LlmRule(raw["rule"]),
                    trigger=LlmTrigger(raw["trigger"]),
                    value=float(raw.get("value") or 0.0),
                )
                self._decisions[n] = LlmDecision(**raw)
        self._last_rule = {n: r for n, r in data.get("last_rule", {}).items() if n in self.models}


def _engine_inputs(load: Any, grant: int) -> dict[str, Any]:
    """What an engine's decision read, for its decision-log entry."""
    return {
        "running": load.running,
        "waiting": load.waiting,
        "ttft_p95_ms": load.ttft_p95_ms,
        "tpot_p95_ms": load.tpot_p95_ms,
        "free_mem_frac": round(load.free_mem_frac, 4),
        "kv_blocks_total": load.kv_blocks_total,
        "kv_blocks_reserved": load.kv_blocks_reserved,
        "idle_for_s": round(load.idle_for_s, 2),
        "grant_bytes": grant,
        "incoming_bytes": load.incoming_bytes,
    }


def _entry(
    now_s: float, name: str, old: LlmState | None, new: LlmState, d: LlmDecision, inputs: dict[str, Any], dry: bool
) -> tuple[dict[str, Any], str]:
    """One engine decision for the decision log: the entry and its log line."""
    grant = inputs["grant_bytes"]
    entry = {
        "kind": EntryKind.ENGINE,
        "time_s": now_s,
        "model": name,
        "trigger": str(d.trigger),
        "rule": str(d.rule),
        "trigger_value": d.value if math.isfinite(d.value) else None,
        "reason": d.reason,
        "inputs": inputs,
        "old": _view(old),
        "new": _view(new),
        "kv_cache_bytes": d.kv_cache_bytes,
        "want_grant_bytes": d.want_grant_bytes,
        "dry_run": dry,
    }
    line = (
        f"{name}: engine {d.rule} [{d.trigger}={d.value:.3g}] {d.reason}; KV cache "
        f"{format_size(d.kv_cache_bytes)} in grant {format_size(grant)}" + (" (dry run)" if dry else "")
    )
    return entry, line
