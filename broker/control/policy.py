"""The card's policy: ``decide(snapshot, config, state) -> (FleetDecision, new_state)``.

Pure and deterministic given its inputs: no ray, torch, pynvml or clock (time is
``snapshot.now_s``). One tick:

1. pick the active price profile (``gpubroker.broker.control.profiles``) -> effective P95 cap and objective;
2. per model, its kind's step (``gpubroker.broker.control.kinds``): fit L(b) and run the batch rules
   (``gpubroker.broker.control.batch_rules``) -> wanted cap/wait;
3. anti-oscillation: a non-safety change inside the hold time is suppressed; direction
   reversals are counted and, past ``reversal_limit`` in ``reversal_window_s``, the dead band
   widens and the hold lengthens (and both relax after a quiet spell);
4. quota (``gpubroker.broker.control.lending``): abort stale transfers, confirm donors now under their grant,
   reclaim base for owners whose load returned, lend from idle models to memory-bound ones;
5. each kind's bounds inside its new grant (an LLM engine's rules) and each model's replica
   target (``gpubroker.broker.control.replica_targets``);
6. guard-rails, in one place: floor <= cap <= min(ceiling, memory ceiling from the grant);
7. versioned settings: a model's version bumps when any of its settings changes.

The decision holds everything the broker applies: per model every setting its replicas run and
its replica target, the quota moves, the replica targets that changed, and log entries.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypedDict

from gpubroker.broker.control.batch_rules import cap_top
from gpubroker.broker.control.kind_batch import settings_for
from gpubroker.broker.control.kinds import kind_for, kinds_of
from gpubroker.broker.control.lending import LendingBook, QuotaInputs, QuotaPlan, plan_quota
from gpubroker.broker.control.memory_model import MemoryModel
from gpubroker.broker.control.model_step import ModelStep, TickView, initial_model_state
from gpubroker.broker.control.replica_targets import replica_target, step_replicas
from gpubroker.broker.control.state import ModelState, PolicyState
from gpubroker.broker.control.types import FleetDecision, FleetSnapshot, ModelDecision, ModelLoad, QuotaMove
from gpubroker.broker.wire import EngineBounds, ModelSettings
from gpubroker.quotas.config import FleetConfig, ModelSpec
from gpubroker.quotas.ledger import ModelQuota, QuotaLedger

# The anti-oscillation's caps (control.band_scale_max, control.hold_max_intervals), the
# emergency recovery (control.emergency_recovery_intervals) and the bounded admission pause
# (control.max_pause_intervals) are tuning constants of the config's control section.


def quotas_of(config: FleetConfig) -> dict[str, ModelQuota]:
    return {n: ModelQuota(m.quota.min, m.quota.base, m.quota.max) for n, m in config.models.items()}


def initial_state(config: FleetConfig, usable_bytes: int) -> PolicyState:
    interval = config.broker.control_interval_s
    return PolicyState(
        models={n: initial_model_state(m, interval) for n, m in config.models.items()},
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
            models[name] = initial_model_state(spec, interval)
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
    engines = {n: e for n, e in state.engines.items() if n in config.models and config.models[n].kind == "llm"}
    replicas = {n: r for n, r in state.replicas.items() if n in config.models}  # clamped by their next tick
    return replace(
        state,
        models=models,
        ledger=ledger,
        confirm_after=after,
        reclaim_steps={},
        restart_tokens=tokens,
        engines=engines,
        replicas=replicas,
    )


def model_settings(state: PolicyState, name: str, config: FleetConfig) -> ModelSettings:
    """A model's versioned settings in ``state`` (its kind's: an engine's carry its bounds)."""
    return kind_for(config.models[name], state.engines.get(name)).settings(state, name, config)


def memory_model(load: ModelLoad) -> MemoryModel:
    return MemoryModel.from_load(load)


class MemoryView(TypedDict):
    """What status says of a model's memory (``memory_view``): the two keys of ``ModelStatus``."""

    memory_ceiling: int | None  # the batch one replica's share of the grant holds
    fixed_bytes: int | None  # the memory model's fixed part


def memory_view(load: ModelLoad | None, spec: ModelSpec, grant_bytes: int) -> MemoryView:
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


def decide(snapshot: FleetSnapshot, config: FleetConfig, state: PolicyState) -> tuple[FleetDecision, PolicyState]:
    """One tick for the fleet: each model's step (its kind's rules), the quota plan over them all,
    then each model's settings inside its new grant and its kind's bounds there."""
    view = TickView.of(snapshot, config, state)
    kinds = kinds_of(config, state.engines)
    notes: list[str] = []
    if state.profile and state.profile != view.profile.name:
        p = view.profile
        notes.append(f"profile {state.profile} -> {p.name} (objective {p.objective}, slack {p.latency_slack:g})")
    steps = {name: kinds[name].step(view, name, spec) for name, spec in config.models.items()}
    notes.extend(f"{name}: {step.note}" for name, step in steps.items() if step.note)
    stepped = {name: step.state for name, step in steps.items()}  # spells and fit (settle_model keeps them)
    plan = plan_quota(
        QuotaInputs(
            snapshot=snapshot,
            config=config,
            states=stepped,
            wants={name: step.want for name, step in steps.items()},
            memory={name: step.memory for name, step in steps.items()},
            kinds=kinds,
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
    bounds = {name: kinds[name].bounds(view, name, spec, plan.ledger) for name, spec in config.models.items()}
    replicas = step_replicas(config, snapshot, stepped, plan.ledger, view.profile, state.replicas)
    decisions: dict[str, ModelDecision] = {}
    new_states: dict[str, ModelState] = {}
    for name, spec in config.models.items():
        target = replica_target(replicas.states, name, spec.replicas)
        decisions[name], new_states[name] = settle_model(
            view, name, spec, steps[name], plan, bounds[name].engine, target
        )
    engines = {name: b.record for name, b in bounds.items() if b.record is not None}
    log = tuple(b.entry for b in bounds.values() if b.entry is not None)
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
        engines=engines,
        replicas=replicas.states,
    )
    decision = FleetDecision(
        now_s=view.now,
        profile=view.profile.name,
        models=decisions,
        moves=plan.moves,
        notes=tuple(notes),
        log=log,
        replicas=replicas.changes,
    )
    return decision, new_state


def settle_model(
    view: TickView,
    name: str,
    spec: ModelSpec,
    step: ModelStep,
    plan: QuotaPlan,
    engine: EngineBounds | None,
    replica_target: int,
) -> tuple[ModelDecision, ModelState]:
    """One model's settings after the quota plan: guard-rails inside its new grant, the version
    bumped when a setting changed, the reclaim flags, its kind's ``engine`` bounds, its
    ``replica_target``, and the reason with the grant's move."""
    state, now = view.state, view.now
    ms, want = step.state, step.want
    grant = plan.ledger.grant(name)
    known = name in state.ledger.quotas
    old_grant = state.ledger.grant(name) if known else grant
    # the reclaim flags before and after this tick as (step up to 2, restart token): the same
    # facts as _quota_flags' settings (steps 2 and 3 both release caches and drain)
    steps, token = plan.reclaim_steps.get(name, 0), plan.restart_tokens.get(name, 0)
    flags_was = (min(2, state.reclaim_steps.get(name, 0)), state.restart_tokens.get(name, 0))
    flags = (min(2, steps), token)
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
        version=version,
        release_cache=steps >= 1,
        drain=steps >= 2,
        restart_token=token,
        engine=engine,
        replica_target=replica_target,
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


__all__ = [
    "ModelState",
    "PolicyState",
    "QuotaMove",
    "decide",
    "initial_state",
    "model_settings",
    "reconfigure_state",
    "settings_for",
]
