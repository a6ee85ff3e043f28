"""The fleet policy: ``decide(snapshot, config, state) -> (FleetDecision, new_state)``.

Pure and deterministic given its inputs: no ray, torch, pynvml or clock (time is
``snapshot.now_s``). One tick:

1. pick the active price profile (``gpubroker.broker.control.profiles``) -> effective P95 cap and objective;
2. per model, fit L(b) and run the batch rules (``gpubroker.broker.control.batch_rules``) -> wanted cap/wait;
3. anti-oscillation: a non-safety change inside the hold time is suppressed; direction
   reversals are counted and, past ``reversal_limit`` in ``reversal_window_s``, the dead band
   widens and the hold lengthens (and both relax after a quiet spell);
4. quota (``gpubroker.broker.control.lending``): abort stale transfers, confirm donors now under their grant,
   reclaim base for owners whose load returned, lend from idle models to memory-bound ones;
5. guard-rails, in one place: floor <= cap <= min(ceiling, memory ceiling from the grant);
6. versioned settings: a model's version bumps when any of its settings changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, NamedTuple

from gpubroker.broker.control.batch_rules import RuleContext, cap_top, decide_batch
from gpubroker.broker.control.latency_model import fit_for_load
from gpubroker.broker.control.lending import LendingBook, QuotaInputs, QuotaPlan, plan_quota
from gpubroker.broker.control.memory_model import MemoryModel
from gpubroker.broker.control.profiles import active_profile
from gpubroker.broker.control.state import BatchWant, ModelState
from gpubroker.broker.control.types import FleetDecision, FleetSnapshot, ModelDecision, ModelLoad, QuotaMove
from gpubroker.broker.control.violation import WATCH_SLACK_BYTES, over_grant
from gpubroker.broker.control.vocab import Rule, Trigger
from gpubroker.broker.wire import ModelSettings
from gpubroker.quotas.config import FleetConfig, ModelSpec
from gpubroker.quotas.ledger import ModelQuota, QuotaLedger
from gpubroker.quotas.schedule import ProfileSpec

# The anti-oscillation's caps (control.band_scale_max, control.hold_max_intervals), the
# emergency recovery (control.emergency_recovery_intervals) and the bounded admission pause
# (control.max_pause_intervals) are tuning constants of the config's control section.
LLM_HOLD_REASON = (
    "llm engine: bounds set by llm_rules"  # kind: llm models skip the batch rules (gpubroker.broker.control.llm_window)
)


@dataclass(frozen=True)
class PolicyState:
    models: Mapping[str, ModelState]
    ledger: QuotaLedger
    profile: str = ""
    tick: int = 0
    # donor -> settings version the donor must run before its pending transfers may complete
    confirm_after: Mapping[str, int] = field(default_factory=dict)
    # reclaim escalation (gpubroker.broker.control.lending): borrower -> step reached; model -> restart token
    reclaim_steps: Mapping[str, int] = field(default_factory=dict)
    restart_tokens: Mapping[str, int] = field(default_factory=dict)
    lend_scale: Mapping[str, float] = field(default_factory=dict)  # model -> idle-hold multiplier (lend regret)
    lent_at: Mapping[str, float] = field(default_factory=dict)  # model -> when it last lent

    def to_dict(self) -> dict[str, Any]:
        return {
            "models": {name: _state_to_dict(s) for name, s in self.models.items()},
            "ledger": self.ledger.to_dict(),
            "profile": self.profile,
            "tick": self.tick,
            "confirm_after": dict(self.confirm_after),
            "reclaim_steps": dict(self.reclaim_steps),
            "restart_tokens": dict(self.restart_tokens),
            "lend_scale": dict(self.lend_scale),
            "lent_at": dict(self.lent_at),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PolicyState:
        models = {}
        for name, raw in data["models"].items():
            raw = dict(raw)
            raw["reversals"] = tuple(raw.get("reversals", ()))
            if raw.get("fit") is not None:
                raw["fit"] = tuple(raw["fit"])
            for key in ("last_change_s", "last_reversal_s", "emergency_s"):
                if raw.get(key) is None:
                    raw[key] = float("-inf")
            models[name] = ModelState(**raw)
        return cls(
            models=models,
            ledger=QuotaLedger.from_dict(data["ledger"]),
            profile=data.get("profile", ""),
            tick=int(data.get("tick", 0)),
            confirm_after={k: int(v) for k, v in data.get("confirm_after", {}).items()},
            reclaim_steps={k: int(v) for k, v in data.get("reclaim_steps", {}).items()},
            restart_tokens={k: int(v) for k, v in data.get("restart_tokens", {}).items()},
            lend_scale={k: float(v) for k, v in data.get("lend_scale", {}).items()},
            lent_at={k: float(v) for k, v in data.get("lent_at", {}).items()},
        )


def _state_to_dict(state: ModelState) -> dict[str, Any]:
    out = state._asdict()
    for key in ("last_change_s", "last_reversal_s", "emergency_s"):
        if out[key] == float("-inf"):
            out[key] = None  # JSON has no -inf
    return out


def quotas_of(config: FleetConfig) -> dict[str, ModelQuota]:
    return {n: ModelQuota(m.quota.min, m.quota.base, m.quota.max) for n, m in config.models.items()}


def _initial_model_state(spec: ModelSpec, interval_s: float) -> ModelState:
    return ModelState(max_batch=spec.batch.initial_cap, wait_s=spec.wait.initial_s, hold_s=interval_s)


def initial_state(config: FleetConfig, usable_bytes: int) -> PolicyState:
    interval = config.broker.control_interval_s
    return PolicyState(
        models={n: _initial_model_state(m, interval) for n, m in config.models.items()},
        ledger=QuotaLedger(usable_bytes, quotas_of(config)),
    )


def reconfigure_state(
    state: PolicyState, config: FleetConfig, usable_bytes: int, now_s: float | None = None
) -> PolicyState:
    """State for a new config: ledger reconfigured (may raise LedgerError), caps clamped into the new range.

    With ``now_s`` the ledger lowers first: a grant the new config lowers drops now and the bytes
    go back to the pool only once the model is measured under it (a pending release; its new
    settings version gates the confirm); nothing rises into memory a model may still hold."""
    ledger = state.ledger.reconfigure(usable_bytes, quotas_of(config), now_s=now_s)
    interval = config.broker.control_interval_s
    models = {}
    for name, spec in config.models.items():
        old = state.models.get(name)
        if old is None:
            models[name] = _initial_model_state(spec, interval)
            continue
        cap = min(spec.batch.ceiling, max(spec.batch.floor, old.max_batch))
        wait = min(spec.wait.max_ms, max(spec.wait.min_ms, old.wait_s * 1000.0)) / 1000.0
        if spec.control.strategy == "static":
            cap, wait = spec.batch.initial_cap, spec.wait.initial_s
        models[name] = old.evolved(
            max_batch=cap, wait_s=wait, version=old.version + 1, hold_s=max(old.hold_s, interval)
        )
    after = {t.donor: models[t.donor].version for t in ledger.pending}
    tokens = {n: v for n, v in state.restart_tokens.items() if n in config.models}
    return replace(state, models=models, ledger=ledger, confirm_after=after, reclaim_steps={}, restart_tokens=tokens)


def settings_for(state: PolicyState, model: str, config: FleetConfig) -> ModelSettings:
    ms = state.models[model]
    return ModelSettings(
        model=model,
        version=ms.version,
        max_batch_size=ms.max_batch,
        batch_wait_timeout_s=ms.wait_s,
        grant_bytes=state.ledger.grant(model),
        admit=ms.admit,
        **_quota_flags(state, model),
    )


def settings_key(state: PolicyState, model: str) -> tuple[Any, ...]:
    """Everything ``settings_for`` reads: equal keys, equal settings (the sign of the wait too:
    0.0 == -0.0, but they are two settings)."""
    ms = state.models[model]
    return (
        (ms.version, ms.max_batch, ms.wait_s, math.copysign(1.0, ms.wait_s), ms.admit),
        (state.ledger.grant(model), state.reclaim_steps.get(model, 0), state.restart_tokens.get(model, 0)),
    )


def _quota_flags(state: PolicyState, model: str) -> dict[str, Any]:
    """The reclaim escalation's settings for ``model`` (gpubroker.broker.control.lending, gpubroker.deployments.units.reclaim)."""
    step = state.reclaim_steps.get(model, 0)
    return {"release_cache": step >= 1, "drain": step >= 2, "restart_token": state.restart_tokens.get(model, 0)}


def memory_model(load: ModelLoad) -> MemoryModel:
    return MemoryModel.from_load(load)


def memory_view(load: ModelLoad | None, spec: ModelSpec, grant_bytes: int) -> dict[str, Any]:
    """What status says of a model's memory, as ``_guard`` sees it: ``memory_ceiling``, the batch
    one replica's share of ``grant_bytes`` holds by the memory model measured from its reports
    (None: no report yet, a static strategy, or not calibrated and no OOM), and ``fixed_bytes``,
    that model's fixed part (the calibrated weights, or the larger fixed part measured live), so a
    user can see why a cap sits below what the config's figures promise."""
    if load is None or spec.control.strategy == "static":
        return {"memory_ceiling": None, "fixed_bytes": None}
    mm = memory_model(load)
    cap = mm.cap_for(grant_bytes / max(1, spec.replicas))
    return {"memory_ceiling": cap, "fixed_bytes": mm.weights_bytes if mm.calibrated else None}


@dataclass(frozen=True)
class _TickView:
    """What every model's step of one tick reads: the tick's inputs and its price profile."""

    snapshot: FleetSnapshot
    config: FleetConfig
    state: PolicyState
    profile: ProfileSpec
    now: float  # snapshot.now_s
    interval: float  # config.broker.control_interval_s

    @cached_property
    def over_grant(self) -> dict[str, int]:
        """Models whose reported use is over their grant (plus what they are still giving away)
        + slack, by how much: a card-level emergency pauses them, not their neighbours (read only
        while the card is short: the emergency rule is its one reader)."""
        ledger, out = self.state.ledger, dict[str, int]()
        if self.snapshot.gpu.free_frac >= self.config.gpu.emergency_free_frac:
            return out
        for name, load in self.snapshot.models.items():
            if name in ledger.quotas:
                allowed = ledger.grant(name) + ledger.outgoing_bytes(name)
                if over_grant(load.mem_used_bytes, allowed, load.replicas):
                    out[name] = load.mem_used_bytes - allowed - max(1, load.replicas) * WATCH_SLACK_BYTES
        return out


class ModelStep(NamedTuple):
    """One model's first pass of a tick: what its batch rules want, before the quota plan."""

    want: BatchWant  # after anti-oscillation, before guard-rails
    state: ModelState  # its state with the tick's spells, fit and reversals
    memory: MemoryModel  # its memory model from this tick's load
    note: str  # anti-oscillation's remark ("" for none)


def decide(
    snapshot: FleetSnapshot,
    config: FleetConfig,
    state: PolicyState,
    need_bytes: Mapping[str, int] | None = None,
) -> tuple[FleetDecision, PolicyState]:
    """One tick for the fleet: each model's step, the quota plan over them all, then each model's
    settings inside its new grant. ``need_bytes``: models whose need the lending planner takes as
    given (LLM engines, gpubroker.broker.control.llm_window)."""
    now, interval = snapshot.now_s, config.broker.control_interval_s
    view = _TickView(snapshot, config, state, active_profile(config.profiles, now), now, interval)
    notes: list[str] = []
    if state.profile and state.profile != view.profile.name:
        p = view.profile
        notes.append(f"profile {state.profile} -> {p.name} (objective {p.objective}, slack {p.latency_slack:g})")
    steps = {name: model_step(view, name, spec) for name, spec in config.models.items()}
    notes.extend(f"{name}: {step.note}" for name, step in steps.items() if step.note)
    plan = plan_quota(
        QuotaInputs(
            snapshot=snapshot,
            config=config,
            states={name: step.state for name, step in steps.items()},
            wants={name: step.want for name, step in steps.items()},
            memory={name: step.memory for name, step in steps.items()},
            need_bytes=need_bytes or {},
        ),
        LendingBook(
            state.ledger,
            state.confirm_after,
            state.reclaim_steps,
            state.restart_tokens,
            state.lend_scale,
            state.lent_at,
        ),
    )
    notes.extend(plan.notes)
    decisions: dict[str, ModelDecision] = {}
    new_states: dict[str, ModelState] = {}
    for name, spec in config.models.items():
        decisions[name], new_states[name] = settle_model(view, name, spec, steps[name], plan)
    # a donor whose grant was lowered this tick must run the new version before it can confirm
    confirm_after = dict(plan.confirm_after)
    for donor in plan.new_donors:
        confirm_after[donor] = new_states[donor].version
    new_state = PolicyState(
        models=new_states,
        ledger=plan.ledger,
        profile=view.profile.name,
        tick=state.tick + 1,
        confirm_after=confirm_after,
        reclaim_steps=plan.reclaim_steps,
        restart_tokens=plan.restart_tokens,
        lend_scale=plan.lend_scale,
        lent_at=plan.lent_at,
    )
    decision = FleetDecision(
        now_s=view.now, profile=view.profile.name, models=decisions, moves=plan.moves, notes=tuple(notes)
    )
    return decision, new_state


def model_step(view: _TickView, name: str, spec: ModelSpec) -> ModelStep:
    """One model's batch rules and anti-oscillation on this tick's load (the quota plan comes after)."""
    now, interval, state = view.now, view.interval, view.state
    old = state.models.get(name) or _initial_model_state(spec, interval)
    load = view.snapshot.models.get(name) or ModelLoad(name=name, replicas=0)
    active = load.arrival_rate_rps > 0 or load.queue_depth > 0
    # utilisation decides lending: quiet = busy share under idle_util_frac with no backlog; a
    # replica refusing requests because it holds over its grant is not quiet (it wants memory)
    quiet = load.busy_frac < spec.control.idle_util_frac and load.queue_depth <= 1 and not load.held_over
    if spec.kind == "llm":  # an engine's queue is exact (running + waiting): the window's busy share
        # trailed a burst's end by the window (5 s of 6, 2026-12-05 runs); its arrivals say whether
        # a short queue is a lull in a steady load (``sequences_arriving``)
        quiet = load.queue_depth <= 1 and sequences_arriving(load) < 1.0
        if not load.replicas:  # no live report: its queue reads 0, which says nothing; the spell goes on as it was
            quiet = old.quiet_since_s is not None
    fit = fit_for_load(load, old.latency_fit)
    mm = memory_model(load)
    # a model is idle from its last arrival, or from the first tick it was seen
    last_arrival = now if (active or old.last_arrival_s is None) else old.last_arrival_s
    if spec.kind == "llm":
        want = BatchWant(old.max_batch, old.wait_s, True, Trigger.HOLD, 0.0, Rule.HOLD, LLM_HOLD_REASON)
    else:
        ctx = _rule_context(view, spec, old, 0.0 if active else now - last_arrival, mm, name)
        want = decide_batch(load, spec, old.max_batch, old.wait_s, fit, view.snapshot.gpu, ctx)
    ms = old.evolved(
        last_arrival_s=last_arrival,
        loaded_since_s=None if quiet else (old.loaded_since_s if old.loaded_since_s is not None else now),
        quiet_since_s=(old.quiet_since_s if old.quiet_since_s is not None else now) if quiet else None,
        fit=None if fit is None else (fit.a_ms, fit.c_ms, fit.samples),
        emergency_s=now if want.rule == Rule.EMERGENCY else old.emergency_s,
    )
    want, ms, note = _anti_oscillation(want, ms, spec, now, interval)
    return ModelStep(want, ms, mm, note)


def sequences_arriving(load: ModelLoad) -> float:
    """The sequences an engine's arrivals keep running (Little's law: the rate window's arrivals
    times their median latency); 0 with no latency in the window. Under a steady 40 req/s of
    ~150 ms requests it is about 6 while the queue dips to one or none for 3-4 s (a lull, or a
    load generator running late), which alone read as quiet: the engine lent, restarted to its
    smallest cache and took its base back 2-3 s later with a queue of 45-96
    (``bench/results/2026-12-05-llm-vllm/lending-8.json``, the independent load)."""
    return load.arrival_rate_rps * (load.p50_ms or 0.0) / 1000.0


def _rule_context(
    view: _TickView, spec: ModelSpec, old: ModelState, idle_for_s: float, mm: MemoryModel, name: str
) -> RuleContext:
    """What the batch rules read besides the load: the profile's cap and objective, the clock's spells."""
    now, interval, config, ledger = view.now, view.interval, view.config, view.state.ledger
    return RuleContext(
        now_s=now,
        slo_ms=spec.slo_p95_ms * view.profile.latency_slack,
        objective=view.profile.objective,
        emergency_free_frac=config.gpu.emergency_free_frac,
        band_scale=old.band_scale,
        idle_for_s=idle_for_s,
        recovering=now - old.emergency_s < spec.control.emergency_recovery_intervals * interval,
        formation=config.broker.batch_formation,
        paused_for_s=0.0 if old.paused_since_s is None else now - old.paused_since_s,
        max_pause_s=spec.control.max_pause_intervals * interval,
        mem_ceiling=mm.cap_for(ledger.grant(name) / max(1, spec.replicas)) if name in ledger.quotas else None,
        over_grant_bytes=view.over_grant.get(name),
        violator_elsewhere=next((m for m in view.over_grant if m != name), "") if view.over_grant else "",
    )


def settle_model(
    view: _TickView, name: str, spec: ModelSpec, step: ModelStep, plan: QuotaPlan
) -> tuple[ModelDecision, ModelState]:
    """One model's settings after the quota plan: guard-rails inside its new grant, the version
    bumped when a setting changed, and the reason with the grant's move."""
    state, now = view.state, view.now
    ms, want = step.state, step.want
    grant = plan.ledger.grant(name)
    known = name in state.ledger.quotas
    old_grant = state.ledger.grant(name) if known else grant
    # the reclaim flags before and after this tick as (step up to 2, restart token): the same
    # facts as _quota_flags' settings (steps 2 and 3 both release caches and drain)
    flags_was = (min(2, state.reclaim_steps.get(name, 0)), state.restart_tokens.get(name, 0))
    flags = (min(2, plan.reclaim_steps.get(name, 0)), plan.restart_tokens.get(name, 0))
    cap, clamp_note = _guard(want.cap, spec, grant, step.memory)
    old = state.models.get(name)
    prev = (old.max_batch, round(old.wait_s, 6), old_grant, old.admit, flags_was) if old and known else None
    changed = prev != (cap, round(want.wait_s, 6), grant, want.admit, flags)
    version = ms.version + (1 if changed and old is not None else 0)
    reason = want.reason + (f"; {clamp_note}" if clamp_note else "")
    if grant != old_grant:
        kinds = sorted({m.kind for m in plan.moves if name in (m.donor, m.recipient)})
        reason += f"; grant {old_grant >> 20}MiB->{grant >> 20}MiB ({', '.join(kinds) or 'ledger'})"
    paused_since = None if want.admit else (ms.paused_since_s if ms.paused_since_s is not None else now)
    moved = (
        {"last_dir": (cap > ms.max_batch) - (cap < ms.max_batch), "last_change_s": now} if cap != ms.max_batch else {}
    )
    ms = ms.evolved(
        max_batch=cap, wait_s=want.wait_s, admit=want.admit, version=version, paused_since_s=paused_since, **moved
    )
    decision = ModelDecision(
        max_batch_size=cap,
        batch_wait_timeout_s=want.wait_s,
        grant_bytes=grant,
        admit=want.admit,
        reason=reason,
        trigger=want.trigger,
        trigger_value=want.value,
        changed=changed,
        rule=want.rule,
    )
    return decision, ms


def _guard(cap: int, spec: ModelSpec, grant_bytes: int, mm: MemoryModel) -> tuple[int, str]:
    """Floor <= cap <= min(ceiling, memory ceiling). Static strategies keep their cap."""
    if spec.control.strategy == "static":
        return cap, ""
    floor = spec.batch.floor
    note = ""
    mem_cap = mm.cap_for(grant_bytes / max(1, spec.replicas))
    top = cap_top(spec.batch, mem_cap)
    if mem_cap is not None and mem_cap < spec.batch.ceiling and cap > top:
        note = f"memory ceiling {mem_cap} from grant {grant_bytes >> 20}MiB"
    new = min(top, max(floor, cap))
    if new != cap and not note:
        note = f"clamped into [{floor}, {top}]"
    return new, note


def _anti_oscillation(
    want: BatchWant, ms: ModelState, spec: ModelSpec, now: float, interval: float
) -> tuple[BatchWant, ModelState, str]:
    ctl = spec.control
    note = ""
    direction = (want.cap > ms.max_batch) - (want.cap < ms.max_batch)
    reversals = ms.reversals  # ascending: pruned only when its oldest left the window
    if reversals and reversals[0] <= now - ctl.reversal_window_s:
        reversals = tuple(t for t in reversals if t > now - ctl.reversal_window_s)
    # relax after a quiet spell
    if ms.band_scale > 1.0 and now - ms.last_reversal_s > 2 * ctl.reversal_window_s:
        ms = ms.evolved(
            band_scale=max(1.0, ms.band_scale / 1.5), hold_s=max(interval, ms.hold_s / 2), last_reversal_s=now
        )
        note = f"no oscillation for {2 * ctl.reversal_window_s:.0f}s: dead band x{ms.band_scale:.2f}, hold {ms.hold_s:.1f}s"
    if direction != 0 and not want.safety and now - ms.last_change_s < ms.hold_s - 1e-9:
        held = want._replace(
            cap=ms.max_batch,
            rule=Rule.HELD,
            reason=f"{want.reason} (held: last change {now - ms.last_change_s:.1f}s ago < hold {ms.hold_s:.1f}s)",
        )
        return held, (ms if reversals is ms.reversals else ms.evolved(reversals=reversals)), note
    if direction != 0 and ms.last_dir != 0 and direction != ms.last_dir:
        reversals = reversals + (now,)
        if len(reversals) >= ctl.reversal_limit:
            ms = ms.evolved(
                band_scale=min(ctl.band_scale_max, ms.band_scale * 1.5),
                hold_s=min(ctl.hold_max_intervals * interval, ms.hold_s * 2),
                last_reversal_s=now,
            )
            note = f"{len(reversals)} reversals in {ctl.reversal_window_s:.0f}s: dead band x{ms.band_scale:.2f}, hold {ms.hold_s:.1f}s"
            reversals = ()
    return want, (ms if reversals is ms.reversals else ms.evolved(reversals=reversals)), note


__all__ = [
    "ModelState",
    "PolicyState",
    "QuotaMove",
    "decide",
    "initial_state",
    "reconfigure_state",
    "settings_for",
    "settings_key",
]
