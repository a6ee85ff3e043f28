"""One model's first pass of a tick, shared by every model kind: its spells, fit and memory model,
the wanted settings its kind's rules give, and anti-oscillation around them.

A kind (``gpubroker.broker.control.kinds``) answers two questions here: whether its model is quiet
(the spell lending reads) and what it wants (its rules); ``step_model`` does the rest the same way
for all. Pure: time is ``TickView.now``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from gpubroker.broker.control.batch_rules import RuleContext
from gpubroker.broker.control.latency_model import LatencyFit, fit_from_sums, fit_sums
from gpubroker.broker.control.llm_rules import EngineRecord
from gpubroker.broker.control.memory_model import MemoryModel
from gpubroker.broker.control.profiles import active_profile
from gpubroker.broker.control.state import BatchWant, ModelState
from gpubroker.broker.control.types import FleetSnapshot, LogLine, ModelLoad
from gpubroker.broker.control.violation import WATCH_SLACK_BYTES, over_grant
from gpubroker.broker.control.vocab import Rule
from gpubroker.broker.wire import EngineBounds
from gpubroker.quotas.config import FleetConfig, ModelSpec
from gpubroker.quotas.ledger import QuotaLedger
from gpubroker.quotas.schedule import ProfileSpec

if TYPE_CHECKING:  # policy imports this module
    from gpubroker.broker.control.state import PolicyState


class TickView(NamedTuple):
    """What every model's step of one tick reads: the tick's inputs, its price profile and the
    models over their grant (``over_grant_of``). Built by ``of``."""

    snapshot: FleetSnapshot
    config: FleetConfig
    state: PolicyState
    profile: ProfileSpec  # the profile in force at snapshot.now_s
    now: float  # snapshot.now_s
    interval: float  # config.broker.control_interval_s
    over_grant: Mapping[str, int]  # model -> bytes over its grant + slack, while the card is short

    @classmethod
    def of(cls, snapshot: FleetSnapshot, config: FleetConfig, state: PolicyState) -> TickView:
        now = snapshot.now_s
        profile = active_profile(config.profiles, now)
        over = over_grant_of(snapshot, config, state.ledger)
        return cls(snapshot, config, state, profile, now, config.broker.control_interval_s, over)


def over_grant_of(snapshot: FleetSnapshot, config: FleetConfig, ledger: QuotaLedger) -> dict[str, int]:
    """Models whose reported use is over their grant (plus what they are still giving away) +
    slack, by how much: a card-level emergency pauses them, not their neighbours. Empty while the
    card is not short (the emergency rule is its one reader)."""
    out: dict[str, int] = {}
    if snapshot.gpu.free_frac >= config.gpu.emergency_free_frac:
        return out
    for name, load in snapshot.models.items():
        if name in ledger.quotas:
            allowed = ledger.grant(name) + ledger.outgoing_bytes(name)
            if over_grant(load.mem_used_bytes, allowed, load.replicas):
                out[name] = load.mem_used_bytes - allowed - max(1, load.replicas) * WATCH_SLACK_BYTES
    return out


class ModelStep(NamedTuple):
    """One model's first pass of a tick: what its rules want, before the quota plan."""

    want: BatchWant  # after anti-oscillation, before guard-rails
    state: ModelState  # its state with the tick's spells, fit and reversals
    memory: MemoryModel  # its memory model from this tick's load
    note: str  # anti-oscillation's remark ("" for none)


class KindBounds(NamedTuple):
    """What a kind sets after the quota plan, inside the new grant (``ModelKind.bounds``)."""

    record: EngineRecord | None  # what its engine rules decided (``PolicyState.engines`` keeps it)
    engine: EngineBounds | None  # the engine bounds its settings carry
    entry: LogLine | None  # their decision-log entry (None: nothing to log)


NO_BOUNDS = KindBounds(None, None, None)  # a kind that sets nothing there


class WantInputs(NamedTuple):
    """What a kind's rules read for one model's wanted settings."""

    view: TickView
    name: str
    spec: ModelSpec
    old: ModelState  # its state from the last tick
    load: ModelLoad
    fit: LatencyFit | None
    memory: MemoryModel
    idle_for_s: float  # since its last arrival (0 while active)


QuietRule = Callable[[ModelLoad, ModelSpec, ModelState], bool]
WantRule = Callable[[WantInputs], BatchWant]


def initial_model_state(spec: ModelSpec, interval_s: float) -> ModelState:
    return ModelState(max_batch=spec.batch.initial_cap, wait_s=spec.wait.initial_s, hold_s=interval_s)


def step_model(view: TickView, name: str, spec: ModelSpec, quiet_rule: QuietRule, want_rule: WantRule) -> ModelStep:
    """One model's rules and anti-oscillation on this tick's load (the quota plan comes after)."""
    now, interval, state = view.now, view.interval, view.state
    old = state.models.get(name) or initial_model_state(spec, interval)
    load = view.snapshot.models.get(name) or ModelLoad(name=name, replicas=0)
    active = load.arrival_rate_rps > 0 or load.queue_depth > 0
    quiet = quiet_rule(load, spec, old)
    fit = fit_from_sums(fit_sums(load.batch_timings), old.latency_fit)  # over its recent batches
    mm = MemoryModel.from_load(load)
    # a model is idle from its last arrival, or from the first tick it was seen
    last_arrival = now if (active or old.last_arrival_s is None) else old.last_arrival_s
    want = want_rule(WantInputs(view, name, spec, old, load, fit, mm, 0.0 if active else now - last_arrival))
    ms = old.evolved(
        last_arrival_s=last_arrival,
        loaded_since_s=None if quiet else (old.loaded_since_s if old.loaded_since_s is not None else now),
        quiet_since_s=(old.quiet_since_s if old.quiet_since_s is not None else now) if quiet else None,
        fit=None if fit is None else (fit.a_ms, fit.c_ms, fit.samples),
        emergency_s=now if want.rule == Rule.EMERGENCY else old.emergency_s,
    )
    want, ms, note = anti_oscillation(want, ms, spec, now, interval)
    return ModelStep(want, ms, mm, note)


def rule_context(w: WantInputs) -> RuleContext:
    """What the batch rules read besides the load: the profile's cap and objective, the clock's spells."""
    view, spec, old, name = w.view, w.spec, w.old, w.name
    now, interval, config, ledger = view.now, view.interval, view.config, view.state.ledger
    return RuleContext(
        now_s=now,
        slo_ms=spec.slo_p95_ms * view.profile.latency_slack,
        objective=view.profile.objective,
        emergency_free_frac=config.gpu.emergency_free_frac,
        band_scale=old.band_scale,
        idle_for_s=w.idle_for_s,
        recovering=now - old.emergency_s < spec.control.emergency_recovery_intervals * interval,
        formation=config.broker.batch_formation,
        paused_for_s=0.0 if old.paused_since_s is None else now - old.paused_since_s,
        max_pause_s=spec.control.max_pause_intervals * interval,
        mem_ceiling=w.memory.cap_for(ledger.grant(name) / max(1, spec.replicas)) if name in ledger.quotas else None,
        over_grant_bytes=view.over_grant.get(name),
        violator_elsewhere=next((m for m in view.over_grant if m != name), "") if view.over_grant else "",
    )


def anti_oscillation(
    want: BatchWant, ms: ModelState, spec: ModelSpec, now: float, interval: float
) -> tuple[BatchWant, ModelState, str]:
    """A non-safety change inside the hold time is suppressed; direction reversals are counted and,
    past ``reversal_limit`` in ``reversal_window_s``, the dead band widens and the hold lengthens
    (both relax after a quiet spell)."""
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
        return held, (ms if reversals == ms.reversals else ms.evolved(reversals=reversals)), note
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
    return want, (ms if reversals == ms.reversals else ms.evolved(reversals=reversals)), note
