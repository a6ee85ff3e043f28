"""The LLM-engine kind: a continuous-batching engine whose bounds and KV cache the broker sets.

The batch rules never run on it (its batch is the engine's own, every step); after the quota plan
its engine rules (``gpubroker.broker.control.llm_rules``) set its bounds and cache inside its new
grant from its latest engine report (``FleetSnapshot.engines``), and what they decided is its
need on the next tick. For lending it differs from a request model in five answers:

- quiet when its queue (running + waiting, exact for an engine) is at most one and its arrivals
  keep under one sequence running (``sequences_arriving``); without a live report its spell goes
  on as it was (its queue then reads 0, which says nothing);
- its working set is its quota min: it allocates its whole cache at start, so its memory in use
  is its cache size, not its demand;
- it hands over (lends at once, or with its arrivals stopped even with a queue) when it borrowed
  for its burst and another engine's burst wants more than that one holds;
- it takes its base back only when its cache binds (it wants more than it holds) and its arrivals
  have not stopped, at once when its queue reaches its expected peak concurrency;
- any loan raises what it runs (no batch ceiling to lift).

Until its rules have decided once (no report yet) it is lent for as a request model is. Pure.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gpubroker.broker.control.kind_batch import BATCH, settings_for
from gpubroker.broker.control.lending import QuotaRound
from gpubroker.broker.control.llm_rules import (
    EngineLoad,
    EngineRecord,
    LlmDecision,
    LlmRule,
    LlmState,
    decide_llm,
    load_from_report,
    rule_config_for,
)
from gpubroker.broker.control.model_step import KindBounds, ModelStep, TickView, WantInputs, step_model
from gpubroker.broker.control.state import BatchWant, ModelState
from gpubroker.broker.control.types import LogLine, ModelLoad
from gpubroker.broker.control.vocab import EntryKind, Rule, Trigger
from gpubroker.broker.wire import DecisionRecord, EngineBounds, ModelSettings
from gpubroker.quotas.config import FleetConfig, ModelSpec
from gpubroker.quotas.ledger import QuotaLedger
from gpubroker.quotas.sizes import format_size

if TYPE_CHECKING:
    from gpubroker.broker.control.state import PolicyState

LLM_HOLD_REASON = "llm engine: bounds set by llm_rules"  # an engine's batch settings hold
ENGINE_KEYS = ("max_num_seqs", "max_batched_tokens", "kv_blocks", "prefill_paused")  # what ModelSettings.engine carries
BACKLOG_ARRIVAL_FRAC = 0.1  # arrivals under this share of completions: the queue is a backlog (backlog_only)


def engine_settings(d: LlmDecision) -> EngineBounds:
    """The bounds a decision sets, as ``ModelSettings.engine`` carries them."""
    return EngineBounds(d.max_num_seqs, d.max_batched_tokens, d.kv_blocks, d.prefill_paused, d.kv_cache_bytes)


def sequences_arriving(load: ModelLoad) -> float:
    """The sequences an engine's arrivals keep running (Little's law: the rate window's arrivals
    times their median latency); 0 with no latency in the window. A steady load's queue dips to
    one or none for seconds at a time: read on its queue alone, the engine would look quiet, lend,
    and take its base back seconds later."""
    return load.arrival_rate_rps * (load.p50_ms or 0.0) / 1000.0


def _quiet(load: ModelLoad, spec: ModelSpec, old: ModelState) -> bool:
    """An engine's queue is exact (running + waiting): the window's busy share trails a burst's
    end by most of the window; its arrivals say whether a short queue is a lull in a steady load."""
    if not load.replicas:  # no live report: its queue reads 0, which says nothing; the spell goes on as it was
        return old.quiet_since_s is not None
    return load.queue_depth <= 1 and sequences_arriving(load) < 1.0


def _hold(w: WantInputs) -> BatchWant:
    return BatchWant(w.old.max_batch, w.old.wait_s, True, Trigger.HOLD, 0.0, Rule.HOLD, LLM_HOLD_REASON)


def backlog_only(r: QuotaRound, name: str) -> bool:
    """Its arrivals have stopped (the last second's under ``BACKLOG_ARRIVAL_FRAC`` of the window's
    completions): its queue is a backlog its own draining for a reclaim sheds, not load."""
    load = r.loads[name]
    return load.recent_arrival_rate_rps < BACKLOG_ARRIVAL_FRAC * load.completion_rate_rps


def _borrowed_at_start(r: QuotaRound, name: str) -> bool:
    """It held a loan as the tick began, a loan being reclaimed from it counted (the tick's own
    release or lend must not end the handover it began); a loan is memory others lent: a grant over
    base from the free pool alone is none."""
    ledger = r.book.ledger  # the tick's starting ledger (the round moves a copy)
    if not any(ledger.lent_bytes(n) >= r.dust for n in r.config.models):
        return False
    reclaiming = sum(t.amount_bytes for t in ledger.pending if t.donor == name and t.kind == "reclaim")
    return ledger.grant(name) + reclaiming - r.config.models[name].quota.base >= r.dust


class LlmKind:
    """LLM engines (``ModelKind``); ``engine``: what its rules decided last (None: not yet)."""

    def __init__(self, engine: EngineRecord | None) -> None:
        self.engine = engine
        self.need_bytes = None if engine is None else engine.decision.want_grant_bytes

    def step(self, view: TickView, name: str, spec: ModelSpec) -> ModelStep:
        return step_model(view, name, spec, _quiet, _hold)

    def need(self, r: QuotaRound, name: str) -> int | None:
        """The grant its engine would use (its rules' ``want_grant_bytes``)."""
        if self.need_bytes is None:
            return BATCH.need(r, name)
        q = r.config.models[name].quota
        return min(q.max, max(q.min, int(self.need_bytes)))

    def working_set(self, r: QuotaRound, name: str) -> int:
        """Its quota min, the cache its rules shrink it to when idle (counting its cache made a lend
        wait for its own idle shrink, a restart)."""
        if self.need_bytes is None:
            return BATCH.working_set(r, name)
        return r.config.models[name].quota.min

    def idle(self, r: QuotaRound, name: str) -> bool:
        """Quiet for its idle hold; none when it hands over, nor quiet at all when its arrivals stopped."""
        handover = self.hands_over(r, name)
        if handover and backlog_only(r, name):
            return True
        hold = 0.0 if handover else r.config.models[name].control.idle_hold_s * r.scale.get(name, 1.0)
        return r.quiet_for(name, hold)

    def hands_over(self, r: QuotaRound, name: str) -> bool:
        """It borrowed for its burst while another engine's burst wants more than it holds: the load
        has moved, so once its queue is empty (or at once, its arrivals stopped) it lends on instead
        of after its idle hold. Not for an engine whose lends came back soon (its idle hold scaled
        up): it waits out its hold."""
        if self.need_bytes is None or r.scale.get(name, 1.0) > 1.0 or not _borrowed_at_start(r, name):
            return False
        return any(other != name and _presses(r, other) for other in r.config.models)

    def reclaims(self, r: QuotaRound, owner: str) -> bool:
        """When its cache binds, not for a stray request; not when its arrivals have stopped (the
        tail of a burst it just handed over, not load back)."""
        if self.need_bytes is None:
            return True
        return (r.need(owner) or 0) > r.holds(owner) and not backlog_only(r, owner)

    def reclaim_hold(self, r: QuotaRound, owner: str, spec: ModelSpec) -> float:
        """None when its queue (running + waiting) has reached its expected peak concurrency: a burst
        no clump of stray requests makes."""
        if self.need_bytes is not None and spec.llm is not None:
            if r.loads[owner].queue_depth >= spec.llm.expected_peak_concurrency:
                return 0.0
        return spec.control.reclaim_hold_s

    def wants_why(self, r: QuotaRound, name: str, wanted: int) -> str:
        if self.need_bytes is None:
            return BATCH.wants_why(r, name, wanted)
        return f"{name} engine wants {format_size(wanted)}, grant {format_size(r.ledger.grant(name))}"

    def borrow_reason(self, r: QuotaRound, name: str, why: str) -> str | None:
        return BATCH.borrow_reason(r, name, why) if self.need_bytes is None else why

    def loan_buys(self, r: QuotaRound, name: str, offers: list[tuple[str, int]]) -> bool:
        return BATCH.loan_buys(r, name, offers) if self.need_bytes is None else True

    def settings(self, state: PolicyState, name: str, config: FleetConfig) -> ModelSettings:
        """Its settings with its engine bounds (once its rules have decided)."""
        s = settings_for(state, name, config)
        return s if self.engine is None else replace(s, engine=engine_settings(self.engine.decision))

    def bounds(self, view: TickView, name: str, spec: ModelSpec, ledger: QuotaLedger) -> KindBounds:
        """Its engine rules on its latest report, under its new grant (and the grant in flight to it);
        with no live report, the bounds its rules decided last (none before their first)."""
        seen = view.snapshot.engines.get(name)
        if seen is None:
            return KindBounds(self.engine, None if self.engine is None else engine_settings(self.engine.decision), None)
        report, replicas = seen.report, max(1, seen.replicas)
        assert spec.llm is not None  # a kind: llm model's config has its llm section
        cfg = rule_config_for(
            spec.llm.expected_peak_concurrency,
            spec.llm.ttft_slo_ms,
            spec.llm.tpot_slo_ms,
            report,
            base_bytes=int(report.weights_bytes),
            idle_hold_s=spec.control.idle_hold_s,
            lend_floor_bytes=int(spec.quota.min) // replicas,
        )
        grant = (ledger.grant(name) if name in ledger.quotas else int(spec.quota.base)) // replicas
        load = load_from_report(
            report, view.now, view.snapshot.gpu.free_frac, grant, ledger.incoming_bytes(name) // replicas
        )
        old = None if self.engine is None else self.engine.state
        decision, state = decide_llm(load, cfg, old)
        last = None if self.engine is None else self.engine.last_rule
        rule_changed = last != decision.rule and decision.rule is not LlmRule.HOLD
        entry = None
        if decision.bounds_changed(old) or rule_changed:  # a change, or a new rule holding (a squeeze's pause)
            entry = _entry(
                view.now, name, old, state, decision, _engine_inputs(load, grant), view.config.broker.dry_run
            )
        return KindBounds(EngineRecord(state, decision, decision.rule), engine_settings(decision), entry)


def _presses(r: QuotaRound, name: str) -> bool:
    """An engine (its rules decided) busy (not quiet) and wanting more than it holds."""
    kind = r.kinds[name]
    if not isinstance(kind, LlmKind) or kind.need_bytes is None:
        return False
    wanted = r.need(name)
    quiet = r.inputs.states[name].quiet_since_s is not None
    return not quiet and wanted is not None and wanted - r.holds(name) >= r.dust


def _view(s: LlmState | None) -> dict[str, Any] | None:
    return None if s is None else {k: getattr(s, k) for k in ENGINE_KEYS}


def _engine_inputs(load: EngineLoad, grant: int) -> dict[str, Any]:
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
) -> LogLine:
    """One engine decision for the decision log: the entry and its log line."""
    grant = inputs["grant_bytes"]
    entry: DecisionRecord = {
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
