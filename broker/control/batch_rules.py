"""Per-model batch rules: from one model's load to a wanted batch cap and wait timeout.

Each rule is ``rule(s: Inputs) -> BatchWant | None`` (``None``: ask the next one);
``control.strategy`` picks a tuple in precedence order (``RULE_SETS``: queue, aimd, model, hybrid,
static), the first answer wins and every adaptive set ends in ``hold``. In ``hybrid`` (the default)
the latency model's plan drives and the emergency, queue, P95 and SM rules guard it, leaving the cap
to the plan when it already does what they ask. docs/RULES.md is this table in prose (a test keeps
them equal). Pure: floor, ceilings and the anti-oscillation hold are applied by the caller
(``gpubroker.broker.control.policy``) in one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from gpubroker.broker.control.batch_plan import BatchPlan, PlanTarget, plan_batch
from gpubroker.broker.control.latency_model import LatencyFit
from gpubroker.broker.control.low_load import WaitGather, wait_gather
from gpubroker.broker.control.profiles import RHO_MAX
from gpubroker.broker.control.state import BatchWant
from gpubroker.broker.control.types import GpuLoad, ModelLoad
from gpubroker.broker.control.vocab import Rule, Trigger
from gpubroker.quotas.config import BatchSpec, ModelSpec


# ------------------------------------------------------------------------------ what the rules see
def cap_top(batch: BatchSpec, mem_cap: int | None) -> int:
    """The largest cap a model's replicas may run: its ceiling, or the batch its grant's memory
    holds (``MemoryModel.cap_for``) where that is lower, never under its floor."""
    return batch.ceiling if mem_cap is None or mem_cap >= batch.ceiling else max(batch.floor, mem_cap)


class RuleContext(NamedTuple):
    """What a model's rules read besides its load and spec: the tick's clock, profile and spells.
    Immutable (a named tuple: one is built per model per tick)."""

    now_s: float
    slo_ms: float  # effective P95 cap (SLO x profile slack)
    objective: str  # throughput | latency | balanced
    emergency_free_frac: float
    band_scale: float  # >= 1, widened by anti-oscillation
    idle_for_s: float  # how long the model has had no arrivals (0 when busy)
    recovering: bool  # an emergency happened recently: grow only by steps
    formation: str = "eager"  # how the runtime forms batches (broker.batch_formation)
    paused_for_s: float = 0.0  # how long this model's admission has been paused
    max_pause_s: float = 3.0  # a pause re-opens after this long (memory that never frees must not starve it)
    mem_ceiling: int | None = None  # the batch the grant holds now (None: memory does not limit): the wait plans for it
    # blame (gpubroker.broker.control.violation.over_grant): this model's reported use over its grant + slack
    # (None: within it), and another model of the card that is over its own ("" for none)
    over_grant_bytes: int | None = None
    violator_elsewhere: str = ""


class Inputs(NamedTuple):
    """What every rule sees: the load, the config, the context, and the numbers derived once.
    Immutable (a named tuple: one is built per model per tick)."""

    load: ModelLoad
    spec: ModelSpec
    ctx: RuleContext
    gpu: GpuLoad
    cap: int  # the cap the replicas run now
    wait_s: float  # the wait timeout they run now
    fit: LatencyFit | None  # the latency model (None: no fit yet, or a strategy without the model)
    plan: BatchPlan | None  # the model's plan at this arrival rate (None without fit or arrivals)
    rate_rps: float  # arrival rate the rules use (burst-aware)
    units_per_s: float  # per replica, in batch units
    queued_units: float  # per replica, in batch units
    qdepth: float  # queue depth per replica (requests waiting or running)
    p95_ms: float | None  # recent P95 (rate window) when it has min_samples, else None
    window_p95_ms: float | None  # the sliding window's P95 when it has min_samples, else None
    # derived once by ``gpubroker.broker.control.batch_rules.inputs_for``: the rules ask these several times a tick
    u: float  # batch units per request (at least 1)
    proposal: int  # the cap the plan asks for (the current cap without a plan): what a guard compares with
    backlog: bool  # more than a batch queued, a queue over the band's top, or arrivals beyond this cap's rate

    def waiting(self, min_depth: float) -> bool:
        """Work waits: more queued than the plan's cap takes at once, or (no plan) a queue of min_depth."""
        if self.plan is not None:
            return self.queued_units > self.proposal
        return self.qdepth >= min_depth if min_depth > 0 else self.qdepth > 0

    def want(
        self,
        new_cap: float,
        trigger: Trigger,
        value: float,
        rule: Rule,
        reason: str,
        *,
        safety: bool = False,
        admit: bool = True,
    ) -> BatchWant:
        """A wanted cap, with the wait that goes with it (the plan's, or the no-plan rule)."""
        new = self.wanted_cap(new_cap)
        wait = self.wait_for(new, backlog=self.qdepth > self.spec.control.band_high)
        return BatchWant(new, wait, admit, trigger, float(value), rule, reason, safety)

    def wait_for(self, cap: int, backlog: bool = False) -> float:
        """The wait timeout for ``cap``: the floor (``wait.min_ms``) where the wait would gather no
        batch the load needs (``floors_wait``), else ``planned_wait``."""
        if self.floors_wait(cap):
            return self.spec.wait.min_ms / 1000.0
        return self.planned_wait(cap, backlog)

    def planned_wait(self, cap: int, backlog: bool = False) -> float:
        """The wait for ``cap`` before the low-load floor: the plan's fill time; without a latency
        model, unchanged unless a backlog builds (then the time to fill the cap at the arrival rate,
        within half the SLO, since only a longer wait makes Ray's batches bigger), and a wait the
        floor holds counts as ``wait.initial_ms`` (what it goes back to). Inside [min_ms, max_ms]."""
        lo, hi = self.spec.wait.min_ms / 1000.0, self.spec.wait.max_ms / 1000.0
        if self.plan is not None:
            w = self.plan.wait_s
        elif backlog and self.units_per_s > 0:
            fill_s = max(0.0, cap - self.u) / self.units_per_s
            w = max(self.wait_s, min(fill_s, self.ctx.slo_ms / 2000.0))
        else:
            w = self.spec.wait.initial_s if self.at_floor() else self.wait_s
        return min(hi, max(lo, w))

    def at_floor(self) -> bool:
        """The replicas run the floor wait now (the low-load hysteresis' state)."""
        return self.wait_s <= self.spec.wait.min_ms / 1000.0 + 1e-9

    def gather(self, cap: int, wait_s: float) -> WaitGather:
        """What a wait of ``wait_s`` with ``cap`` gathers per replica at this tick's rate."""
        solo_ms = None if self.fit is None else self.fit.predict_ms(self.u)
        rho_max = RHO_MAX.get(self.ctx.objective, 0.8)
        rate = self.rate_rps / max(1, self.load.replicas)
        seen = max(0.0, self.load.mean_batch / self.u - 1.0)  # requests the window's batches held beyond one
        return wait_gather(rate, wait_s, cap / self.u, solo_ms, rho_max, self.gpu.sm_util_frac, seen)

    def floors_wait(self, cap: int) -> bool:
        """The low-load floor holds for ``cap``: no backlog, and the planned wait gathers no batch
        the load needs (``gpubroker.broker.control.low_load``, with its hysteresis)."""
        return not self.backlog and self.gather(cap, self.planned_wait(cap)).floors(self.at_floor())

    def wanted_cap(self, new_cap: float) -> int:
        """The cap ``want`` asks for ``new_cap``: rounded, at least 1, grown no further than the plan's useful batch."""
        new = max(1, round(new_cap))
        if self.plan is not None and new > self.cap and math.isfinite(self.plan.useful):
            new = min(new, max(self.cap, math.ceil(self.plan.useful)))  # no rule grows a lazy cap past it
        return new

    def hold(self, trigger: Trigger, value: float, rule: Rule, reason: str) -> BatchWant:
        """Keep the cap and the wait as they are."""
        return BatchWant(self.cap, self.wait_s, True, trigger, float(value), rule, reason)


def _p95_text(s: Inputs) -> str:
    return f"p95_ms {s.p95_ms:.1f} > {s.spec.control.p95_near_frac:g}x cap {s.ctx.slo_ms:.0f}"


# ------------------------------------------------------------------------------ the rules
def static(s: Inputs) -> BatchWant:
    return BatchWant(
        s.cap, s.wait_s, True, Trigger.STATIC, float(s.cap), Rule.STATIC, f"static strategy holds batch {s.cap}"
    )


def emergency(s: Inputs) -> BatchWant | None:
    """Free memory under gpu.emergency_free_frac, or a replica's fast loop shrank: halve now."""
    free, limit = s.gpu.free_frac, s.ctx.emergency_free_frac
    if not (free < limit or s.load.emergency):
        return None
    over, elsewhere = s.ctx.over_grant_bytes, s.ctx.violator_elsewhere
    if free < limit and over is None and elsewhere and not s.load.emergency:
        return None  # blame: the card is short while a neighbour is over its grant; this model keeps serving
    new = max(s.spec.batch.floor, min(s.cap // 2, int(s.queued_units // 2)))
    admit = free >= limit / 2.0
    why = f"free_frac {free:.3f} < {limit}" if free < limit else "replica reported an emergency shrink"
    what = f"{why}: halve batch {s.cap}->{new}"
    if free < limit and over is not None:  # the card is short and this model is over its grant: it pays
        what += f", pause admission: {over / 2**20:.1f} MiB over its grant + slack"
        return s.want(new, Trigger.FREE_FRAC, free, Rule.EMERGENCY, what, safety=True, admit=False)
    if not admit and s.ctx.paused_for_s >= s.ctx.max_pause_s:
        admit = True  # bounded pause: re-open at the floor (the replica's fast loop still guards each batch)
        what += f", re-open admission after {s.ctx.paused_for_s:.0f}s paused"
    elif not admit:
        what += ", pause admission"
    return s.want(new, Trigger.FREE_FRAC, free, Rule.EMERGENCY, what, safety=True, admit=admit)


def _p95_near(s: Inputs) -> bool:
    return s.p95_ms is not None and s.p95_ms > s.spec.control.p95_near_frac * s.ctx.slo_ms


def p95_queueing(s: Inputs) -> BatchWant | None:
    """P95 near the cap with a backlog: the latency is queueing, shrinking would make it worse: grow."""
    if not (_p95_near(s) and s.backlog):
        return None
    assert s.p95_ms is not None  # _p95_near read it
    ceiling = s.spec.batch.ceiling
    why = f"{_p95_text(s)} with a backlog ({s.queued_units:.0f} queued, arrivals {s.units_per_s:.1f}/s)"
    if s.plan is not None:
        if s.plan.cap > s.cap:
            return s.want(
                s.plan.cap,
                Trigger.P95_MS,
                s.p95_ms,
                Rule.P95_QUEUEING,
                f"{why}: grow {s.cap}->{round(s.plan.cap)}",
                safety=True,
            )
        return None
    if s.cap < ceiling:
        new = min(ceiling, s.cap * 2)
        return s.want(new, Trigger.P95_MS, s.p95_ms, Rule.P95_QUEUEING, f"{why}: grow {s.cap}->{new}", safety=True)
    return None


def p95_high(s: Inputs) -> BatchWant | None:
    """P95 near the cap without a backlog: the batch itself is too slow: shrink multiplicatively.
    With a plan, only when the plan also puts the cap above its own (else the high P95 is a
    transient the plan's cap drains: shrinking under it starves the next burst), and not
    below the plan's cap (nor above b_lat)."""
    if not _p95_near(s) or s.backlog:
        return None
    assert s.p95_ms is not None  # _p95_near read it
    ctl, floor = s.spec.control, s.spec.batch.floor
    new = s.cap * ctl.aimd_backoff
    if s.plan is not None:
        if s.plan.cap >= s.cap:
            return None
        new = max(new, min(s.plan.cap, s.cap - 1))
        if s.plan.b_lat >= floor:
            new = min(new, max(s.plan.b_lat, s.plan.cap))
    new = max(floor, math.floor(new))
    if new >= s.cap:
        return None
    return s.want(
        new,
        Trigger.P95_MS,
        s.p95_ms,
        Rule.P95_HIGH,
        f"{_p95_text(s)} without a backlog: shrink {s.cap}->{new}",
        safety=True,
    )


def idle(s: Inputs) -> BatchWant | None:
    """No arrivals for idle_hold_s. Eager formation: the floor (the cap is what a burst forms its
    first batches with; the floor is the least memory a batch takes). Lazy formation: hold the cap:
    batches size themselves to the load, so an idle model's big cap costs no memory, while a cap
    at the floor would meet the next burst with batches of the floor until the next tick. What an
    idle model lends follows its measured use either way (``gpubroker.broker.control.lending``), and a lowered grant
    clamps the cap through the memory ceiling. The answer names the hold, not how long the model
    has been idle: it stays the same while the model stays idle."""
    if s.ctx.idle_for_s < s.spec.control.idle_hold_s or s.load.queue_depth > 0:
        return None
    floor, rate = s.spec.batch.floor, s.load.arrival_rate_rps
    if s.ctx.formation == "lazy":
        return s.want(
            s.cap,
            Trigger.ARRIVAL_RATE_RPS,
            rate,
            Rule.IDLE,
            f"no arrivals for {s.spec.control.idle_hold_s:g}s or more: lazy batches size themselves, hold batch {s.cap}",
        )
    if s.cap > floor:
        return s.want(
            floor,
            Trigger.ARRIVAL_RATE_RPS,
            rate,
            Rule.IDLE,
            f"no arrivals for {s.spec.control.idle_hold_s:g}s or more: batch {s.cap}->{floor}",
        )
    return s.want(s.cap, Trigger.ARRIVAL_RATE_RPS, rate, Rule.IDLE, "idle at the floor")


def _plan_grows(s: Inputs) -> bool:
    """Would the model rule (below the guards) raise the cap this tick?"""
    w = model(s)
    return w is not None and w.cap > s.cap


def sm_busy(s: Inputs) -> BatchWant | None:
    """SM utilisation near 100% with P95 rising (recent over window) while the plan would grow
    the cap: hold cap and wait. Without a plan, p95_low checks this itself."""
    sm, ctl = s.gpu.sm_util_frac, s.spec.control
    if (
        sm is None
        or sm < ctl.sm_high_frac
        or s.p95_ms is None
        or s.window_p95_ms is None
        or s.p95_ms <= s.window_p95_ms
    ):
        return None
    if not _plan_grows(s):
        return None
    return s.hold(
        Trigger.SM_UTIL_FRAC,
        sm,
        Rule.SM_BUSY,
        f"sm_util_frac {sm:.2f} >= {ctl.sm_high_frac} with p95_ms rising {s.window_p95_ms:.1f}->{s.p95_ms:.1f}: "
        f"hold {s.cap} (plan {s.proposal})",
    )


def sm_low(s: Inputs) -> BatchWant | None:
    """SM utilisation under sm_low_frac with work waiting: the card idles for want of batch: grow by a step."""
    sm, ctl, ceiling = s.gpu.sm_util_frac, s.spec.control, s.spec.batch.ceiling
    if sm is None or sm >= ctl.sm_low_frac or not s.waiting(0) or s.cap >= ceiling:
        return None
    new = min(ceiling, s.cap + ctl.aimd_step)
    if new <= s.proposal:
        return None  # the plan grows at least as far
    return s.want(
        new,
        Trigger.SM_UTIL_FRAC,
        sm,
        Rule.SM_LOW,
        f"sm_util_frac {sm:.2f} < {ctl.sm_low_frac} with queue {s.qdepth:.0f}: grow {s.cap}->{new}",
    )


def _band(s: Inputs) -> tuple[float, float]:
    ctl = s.spec.control
    return ctl.band_high * s.ctx.band_scale, ctl.band_low / s.ctx.band_scale


def queue_high(s: Inputs) -> BatchWant | None:
    """Queue above the dead band's top (with a plan: and more queued than the plan's cap): scale up in proportion."""
    ctl, ceiling = s.spec.control, s.spec.batch.ceiling
    high, _ = _band(s)
    if s.qdepth <= high or (s.plan is not None and s.queued_units <= s.proposal):
        return None
    new = min(ceiling, s.cap * min(2.0, s.qdepth / max(ctl.target_queue, 1)))
    if s.ctx.recovering:
        new = min(new, s.cap + ctl.aimd_step)
    if int(new) <= max(s.cap, s.proposal):
        return None
    return s.want(
        int(new),
        Trigger.QUEUE_DEPTH,
        s.qdepth,
        Rule.QUEUE_HIGH,
        f"queue_depth {s.qdepth:.0f} > band top {high:.0f}: grow {s.cap}->{int(new)}",
    )


def queue_low(s: Inputs) -> BatchWant | None:
    """Queue below the dead band's bottom with P95 well under the cap: scale down in proportion.
    With a plan, only down to the plan's cap, and only where the model rule would not move
    (its dead band): the plan's burst headroom is what a short queue leaves room for."""
    ctl, floor = s.spec.control, s.spec.batch.floor
    _, low = _band(s)
    if not (
        s.qdepth < low
        and s.load.arrival_rate_rps > 0
        and s.p95_ms is not None
        and s.p95_ms < ctl.p95_low_frac * s.ctx.slo_ms
    ):
        return None
    if s.cap <= floor or (s.plan is not None and (s.cap <= s.proposal or model(s) is not None)):
        return None
    new = max(floor, int(s.cap * max(0.5, s.qdepth / max(ctl.target_queue, 1))))
    if s.plan is not None:
        new = max(new, s.proposal)
    if new >= s.cap:
        return None
    return s.want(
        new,
        Trigger.QUEUE_DEPTH,
        s.qdepth,
        Rule.QUEUE_LOW,
        f"queue_depth {s.qdepth:.0f} < band bottom {low:.0f}: shrink {s.cap}->{new}",
    )


def p95_low(s: Inputs) -> BatchWant | None:
    """P95 well under the cap with work waiting (and the card not saturated): grow by aimd_step."""
    ctl, ceiling = s.spec.control, s.spec.batch.ceiling
    sm_busy_now = s.gpu.sm_util_frac is not None and s.gpu.sm_util_frac >= ctl.sm_high_frac
    if (
        s.p95_ms is None
        or s.p95_ms >= ctl.p95_low_frac * s.ctx.slo_ms
        or not s.waiting(1)
        or s.cap >= ceiling
        or sm_busy_now
    ):
        return None
    new = min(ceiling, s.cap + ctl.aimd_step)
    if new <= s.proposal:
        return None  # the plan grows at least as far
    return s.want(
        new,
        Trigger.P95_MS,
        s.p95_ms,
        Rule.P95_LOW,
        f"p95_ms {s.p95_ms:.1f} < {ctl.p95_low_frac:g}x cap with queue {s.qdepth:.0f}: grow {s.cap}->{new}",
    )


def low_load(s: Inputs) -> BatchWant | None:
    """The wait would gather no batch the load needs (fewer than one arrival expected in it, or a
    cap of one request, with no backlog; ``gpubroker.broker.control.low_load``): it goes to the
    floor, ``wait.min_ms``, with the cap the model rule asks (or the cap as it is). It answers the
    tick the wait moves there; from then on every rule's wait stays at the floor
    (``Inputs.wait_for``) until the load leaves it."""
    if s.at_floor() or s.backlog:
        return None
    planned = model(s)
    cap = s.cap if planned is None else planned.cap
    wait_s = s.planned_wait(cap)
    g = s.gather(cap, wait_s)
    if wait_s <= s.spec.wait.min_ms / 1000.0 or not g.floors(at_floor=False):
        return None
    moved = f", cap {s.cap}->{cap}" if cap != s.cap else ""
    return s.want(
        cap,
        Trigger.ARRIVAL_RATE_RPS,
        s.rate_rps,
        Rule.LOW_LOAD,
        f"arrival_rate_rps {s.rate_rps:.2f}: {g.why(wait_s)}: wait {s.wait_s * 1000:.1f}->{s.spec.wait.min_ms:.1f} ms"
        f"{moved}",
    )


def model(s: Inputs) -> BatchWant | None:
    """The latency model's plan, when cap or wait move by more than the (widened) dead band."""
    plan, fit = s.plan, s.fit
    if plan is None or fit is None:
        return None
    ctl, cap, wait_s = s.spec.control, s.cap, s.wait_s
    target = plan.cap
    new = min(target, cap + ctl.aimd_step) if s.ctx.recovering and target > cap else target
    rel = abs(new - cap) / max(cap, 1)
    wait_new = s.wait_for(max(1, round(new)))
    wait_rel = abs(wait_new - wait_s) / max(wait_s, 1e-3)
    wait_moves = wait_rel > 0.2 * s.ctx.band_scale
    if not ((rel > 0.1 * s.ctx.band_scale and round(new) != cap) or wait_moves):
        return None
    rho = "overload" if not math.isfinite(plan.rho) else f"{plan.rho:.2f}"
    head = (
        f"arrival_rate_rps {s.rate_rps:.1f} with L(b)={fit.a_ms:.1f}+{fit.c_ms:.3f}b ms: "
        f"batch {plan.batch:.1f} at utilisation {rho} fills in {plan.wait_s * 1000:.1f} ms "
        f"(est. P95 {plan.est_ms:.0f} ms): cap {cap}->{round(new)}, "
    )
    wanted = s.wanted_cap(new)
    if not wait_moves and runs_at(wanted, s) == cap:
        # The floor, the ceiling or the grant's memory keeps the cap where it is: the want still
        # asks for its cap (lending reads it), but the wait moves only past its own dead band, or
        # a pinned cap would push a new settings version every tick for a wait microseconds off.
        # (``s.want`` with the wait as it is: its own wait would be dropped.)
        reason = f"{head}wait held at {wait_s * 1000:.1f} ms (inside its dead band)"
        return BatchWant(wanted, wait_s, True, Trigger.ARRIVAL_RATE_RPS, float(s.rate_rps), Rule.MODEL, reason)
    left = ""
    if s.at_floor() and wait_new > wait_s:  # the low-load floor let go: say at what load
        left = f" (off the low-load floor: {s.gather(wanted, wait_new).why(wait_new)})"
    return s.want(
        new,
        Trigger.ARRIVAL_RATE_RPS,
        s.rate_rps,
        Rule.MODEL,
        f"{head}wait {wait_s * 1000:.1f}->{wait_new * 1000:.1f} ms{left}",
    )


def runs_at(cap: int, s: Inputs) -> int:
    """The cap the replicas would run for a wanted ``cap``: inside the floor and the ceiling and
    under the batch the grant holds now (``RuleContext.mem_ceiling``), as the policy's guard
    clamps it (``gpubroker.broker.control.policy._guard``; a grant this tick's lending changes moves that one)."""
    return min(cap_top(s.spec.batch, s.ctx.mem_ceiling), max(s.spec.batch.floor, cap))


def hold(s: Inputs) -> BatchWant:
    """Nothing to do: keep the cap (inside the queue band, or the model plan within its dead band)."""
    if s.plan is not None:
        return s.hold(
            Trigger.ARRIVAL_RATE_RPS,
            s.rate_rps,
            Rule.HOLD,
            f"arrival_rate_rps {s.rate_rps:.1f}: model plan within the dead band, hold batch {s.cap}",
        )
    high, low = _band(s)
    return s.want(
        s.cap,
        Trigger.QUEUE_DEPTH,
        s.qdepth,
        Rule.HOLD,
        f"queue_depth {s.qdepth:.0f} inside band [{low:.0f}, {high:.0f}]: hold {s.cap}",
    )


RuleFn = Callable[[Inputs], "BatchWant | None"]

# control.strategy -> its rules in precedence order (first answer wins). docs/RULES.md.
RULE_SETS: dict[str, tuple[RuleFn, ...]] = {
    "static": (static,),
    "queue": (emergency, idle, queue_high, queue_low, low_load, hold),
    "aimd": (emergency, p95_queueing, p95_high, idle, p95_low, low_load, hold),
    "model": (emergency, idle, low_load, model, hold),
    "hybrid": (
        emergency,
        p95_queueing,
        p95_high,
        idle,
        sm_busy,
        queue_high,
        queue_low,
        sm_low,
        p95_low,
        low_load,
        model,
        hold,
    ),
}
# every rule in one precedence order (each set keeps this order): the rows of docs/RULES.md
RULES: tuple[RuleFn, ...] = (
    static,
    emergency,
    p95_queueing,
    p95_high,
    idle,
    sm_busy,
    queue_high,
    queue_low,
    sm_low,
    p95_low,
    low_load,
    model,
    hold,
)


def rule_name(fn: RuleFn) -> Rule:
    return Rule(fn.__name__)


def uses_model(strategy: str) -> bool:
    return model in RULE_SETS[strategy]


def inputs_for(
    load: ModelLoad, spec: ModelSpec, cap: int, wait_s: float, fit: LatencyFit | None, gpu: GpuLoad, ctx: RuleContext
) -> Inputs:
    """Derive the rules' numbers once: burst-aware rate, per-replica units, P95s, the plan."""
    ctl = spec.control
    replicas = max(1, load.replicas)
    # fast attack, slow decay: a burst (the last couple of reports well over the window's rate)
    # is taken at once; ordinary report-to-report noise is not (it would make the wait jitter)
    rate_rps = load.arrival_rate_rps
    if load.recent_arrival_rate_rps > ctl.burst_factor * load.arrival_rate_rps:
        rate_rps = load.recent_arrival_rate_rps
    units_per_s = rate_rps * max(load.cost_per_request, 1e-9) / replicas
    queued_units = load.queue_depth * max(load.cost_per_request, 1.0) / replicas
    fit = fit if uses_model(ctl.strategy) else None  # queue / aimd do without the latency model
    plan = None
    if fit is not None and units_per_s > 0:
        # A backlog (more than a batch queued) drains only with spare capacity: plan bigger
        # batches (utilisation at most drain_rho) until it is gone.
        draining = load.queue_depth / replicas > ctl.band_high and queued_units > cap
        target = PlanTarget(ctx.slo_ms, ctx.objective, spec.batch.ceiling, ctx.formation, ctx.mem_ceiling)
        plan = plan_batch(
            fit, units_per_s, max(load.cost_per_request, 1.0), target, ctl.drain_rho if draining else None
        )
    # The AIMD reacts to the recent P95 (rate window, a few seconds, never one sample); the
    # 30 s window P95 would keep "breaching" long after a transient and shrink too far.
    p95 = load.recent_p95_ms if load.recent_samples >= ctl.min_samples else None
    window_p95 = load.p95_ms if load.latency_samples >= ctl.min_samples else None
    qdepth = load.queue_depth / replicas
    # backlog: more than a batch queued, a queue over the band's top, or arrivals beyond this cap's rate
    overloaded = fit is not None and units_per_s > 0.95 * fit.saturated_rate(cap)
    backlog = queued_units > cap or qdepth > ctl.band_high or overloaded
    return Inputs(
        load=load,
        spec=spec,
        ctx=ctx,
        gpu=gpu,
        cap=cap,
        wait_s=wait_s,
        fit=fit,
        plan=plan,
        rate_rps=rate_rps,
        units_per_s=units_per_s,
        queued_units=queued_units,
        qdepth=qdepth,
        p95_ms=p95,
        window_p95_ms=window_p95,
        u=max(load.cost_per_request, 1.0),
        proposal=cap if plan is None else max(1, round(plan.cap)),
        backlog=backlog,
    )


def decide_batch(
    load: ModelLoad, spec: ModelSpec, cap: int, wait_s: float, fit: LatencyFit | None, gpu: GpuLoad, ctx: RuleContext
) -> BatchWant:
    """The first rule of the strategy's set that answers."""
    s = inputs_for(load, spec, cap, wait_s, fit, gpu, ctx)
    for rule in RULE_SETS[spec.control.strategy]:
        want = rule(s)
        if want is not None:
            return want
    raise AssertionError(
        f"rule set '{spec.control.strategy}' ended without an answer; its last rule must always answer"
    )
