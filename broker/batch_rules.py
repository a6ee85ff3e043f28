"""Per-model batch rules: from one model's load to a wanted batch cap and wait timeout.

Design note. Ray 2.60's ``@serve.batch`` forms batches eagerly: as soon as a request
arrives its loop starts a batch, closes it at ``max_batch_size`` or after
``batch_wait_timeout_s``, and only then queues it for one of ``max_concurrent_batches``
slots. A batch does not grow while the replica is busy, so with a zero wait timeout every
request under load becomes a batch of one and the replica saturates at 1/a. The wait timeout,
not the cap, sets the batch size under load; the cap bounds what a burst may form. With
``L(b) = a + c*b`` and arrival rate lambda, a batch b runs at utilisation
``lambda (a + c b) / b``; the plan picks the batch (and the wait that fills it) that keeps the
estimated P95 lowest. With ``broker.batch_formation: lazy`` (the next batch forms when the
replica is free) batches size themselves instead, at ``lambda a / (1 - lambda c)``, and the
plan keeps the wait short. The rules, first match wins:

- ``emergency``: free memory under ``gpu.emergency_free_frac`` (or the replica's fast loop
  shrank): cap = max(floor, min(cap/2, queued/2)); admission pauses below half of it, for at
  most ``max_pause_s`` (memory that never frees must not starve the fleet).
- ``p95``: recent P95 (the rate window, a few seconds) near the cap (``p95_near_frac``). With
  a backlog (more than a batch queued, or arrivals beyond what the cap serves) the latency
  is queueing: grow toward the throughput target. Without one, the batch itself is too slow:
  shrink multiplicatively (``aimd_backoff``) -- with a latency model only when the model also
  puts the cap above its target, since otherwise the P95 is a transient that is draining.
- ``idle``: no arrivals for ``idle_hold_s``: go to the floor (that is what lets it lend memory).
- ``model``: with a fitted L(b) and an arrival rate, ``plan_batch`` picks the batch whose
  utilisation minimises the estimated P95 (formation wait + L(b) + queueing) and the wait
  that fills it at the arrival rate (a backlog plans at utilisation ``DRAIN_RHO`` until it
  drains); the cap leaves headroom over it for bursts (at least b_lat, the largest batch with
  2 L(b) <= cap). Only moves when cap or wait change by more than the (oscillation-widened)
  dead band.
- ``queue``: no fit yet: above the dead band's top scale up in proportion, below its bottom
  scale down, inside hold.
- ``sm_util``: SM utilisation under ``sm_low_frac`` with work waiting: grow by a step.
- ``p95_low``: P95 well under the cap with backlog: grow by ``aimd_step``.

The wait timeout is the plan's fill time (without a latency model it holds, except under a
backlog: then the time to fill the cap at the arrival rate within half the SLO), inside
[min_ms, max_ms]. The arrival rate is the rate window's, or the last two reports' when they
run ``BURST_FACTOR`` over it (a burst is seen at once, a lull only after the window).

Everything here is pure; guard-rails (floor, ceiling, memory ceiling) are applied by the
caller in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from broker.latency_model import LatencyFit
from broker.profiles import BATCH_HEADROOM, RHO_MAX
from broker.state import BatchWant
from broker.types import GpuLoad, ModelLoad
from quotas.config import ModelSpec


@dataclass(frozen=True)
class RuleContext:
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


@dataclass(frozen=True)
class BatchPlan:
    """What the latency model says for the current arrival rate (per replica)."""

    batch: float  # batch that keeps utilisation at ``rho`` (the batch the wait timeout fills)
    wait_s: float  # time to fill that batch at the arrival rate (before the config's clamp)
    rho: float  # utilisation aimed for (inf: the rate is beyond what any batch serves)
    b_lat: float  # largest batch with 2 L(b) <= cap (what a burst may form at most, latency-wise)
    est_ms: float  # estimated P95: wait + L(batch) + queueing
    cap: float  # batch cap: headroom over ``batch`` for bursts, at least b_lat, within the ceiling


DRAIN_RHO = 0.6  # utilisation the plan aims for while a backlog drains
BURST_FACTOR = 1.3  # the last reports' arrival rate counts when it is this far over the window's
LAZY_WAIT_BUDGET_FRAC = {"latency": 0.1, "balanced": 0.25, "throughput": 0.5}


def _queue_ms(rho: float, service_ms: float, batch: float) -> float:
    """Wait for the executor, Kingman's G/D/1 approximation x 2 as a tail proxy. A batch closes
    a fixed wait after its first request, and that first request comes after an exponential
    gap, so batch inter-arrival CV^2 is about 1 / b^2: big batches arrive almost evenly."""
    ca2 = 1.0 / max(batch, 1.0) ** 2
    return 2.0 * rho / (1.0 - rho) * ca2 / 2.0 * service_ms


def plan_batch(fit: LatencyFit, units_per_s: float, unit_per_request: float, slo_ms: float, objective: str, ceiling: int,
               rho_cap: float | None = None, formation: str = "eager") -> BatchPlan:
    """Batch and wait timeout for Ray 2.60's @serve.batch.

    Ray forms the next batch as soon as a request arrives (first request + wait timeout, or
    max_batch_size reached) and only then queues it for a free max_concurrent_batches slot:
    batches do not grow while the replica is busy. So the wait timeout is what sets the batch
    size under load: a batch of b at utilisation rho = lambda (a + c b) / b needs
    b = lambda a / (rho - lambda c), filled in (b - u) / lambda. The utilisation is chosen
    from a few candidates (up to the objective's ceiling) to minimise the estimated P95:
    formation wait + L(b) + queueing for the executor.
    """
    lam = units_per_s / 1000.0  # units per ms
    u = max(unit_per_request, 1.0)
    b_lat = fit.largest_batch_within(slo_ms / 2.0)
    headroom = BATCH_HEADROOM.get(objective, 2.0)
    if formation == "lazy":
        return _plan_lazy(fit, lam, u, b_lat, headroom, slo_ms, objective, ceiling)
    if lam <= 0:
        return BatchPlan(u, 0.0, 0.0, b_lat, fit.predict_ms(u), min(float(ceiling), max(b_lat, u)))
    rho_max = RHO_MAX.get(objective, 0.8) if rho_cap is None else min(rho_cap, RHO_MAX.get(objective, 0.8))
    best: tuple[float, float, float] | None = None  # (est, rho, b)
    rho = 0.3
    while rho <= rho_max + 1e-9:
        if rho > lam * fit.c_ms:
            b = max(u, lam * fit.a_ms / (rho - lam * fit.c_ms))
            real_rho = lam * fit.predict_ms(b) / b
            if real_rho < 1.0:
                est = (b - u) / lam + fit.predict_ms(b) + _queue_ms(real_rho, fit.predict_ms(b), b / u)
                if best is None or est < best[0]:
                    best = (est, real_rho, b)
        rho += 0.05
    if best is None:  # beyond what the ceiling's batch can serve: biggest batches, drain
        b = float(ceiling)
        return BatchPlan(b, (b - u) / lam / 1000.0, math.inf, b_lat, math.inf, float(ceiling))
    est, rho, b = best
    cap = min(float(ceiling), max(b_lat, b * headroom))
    return BatchPlan(min(b, float(ceiling)), max(0.0, (b - u) / lam) / 1000.0, rho, b_lat, est, cap)


def _plan_lazy(fit: LatencyFit, lam: float, u: float, b_lat: float, headroom: float, slo_ms: float, objective: str,
               ceiling: int) -> BatchPlan:
    """Lazy formation (the next batch forms when the replica is free): batches size themselves
    to the load at the fixed point b = lambda a / (1 - lambda c), so no wait is needed under
    load; the cap leaves headroom for bursts, and a short wait (a share of the SLO budget left
    after two batches) only helps an idle replica gather a few requests."""
    denom = 1.0 - lam * fit.c_ms
    b_fp = lam * fit.a_ms / denom if (lam > 0 and denom > 0) else (0.0 if lam <= 0 else math.inf)
    want = min(float(ceiling), b_fp * headroom) if math.isfinite(b_fp) else float(ceiling)
    cap = min(float(ceiling), max(b_lat, want, u))
    budget_s = max(0.0, slo_ms - 2.0 * fit.predict_ms(cap)) / 1000.0 * LAZY_WAIT_BUDGET_FRAC.get(objective, 0.25)
    fill_s = cap / (lam * 1000.0) if lam > 0 else 0.0
    batch = max(u, b_fp) if math.isfinite(b_fp) else float(ceiling)
    rho = lam * fit.predict_ms(batch) / batch if math.isfinite(b_fp) and lam > 0 else (0.0 if lam <= 0 else math.inf)
    return BatchPlan(batch, min(fill_s, budget_s), rho, b_lat, 2.0 * fit.predict_ms(batch), cap)


def wait_for(plan: BatchPlan | None, cap: int, units_per_s: float, unit_per_request: float, slo_ms: float, spec: ModelSpec, current_s: float, backlog: bool = False) -> float:
    """The wait timeout: the plan's fill time; without a latency model, unchanged unless a
    backlog builds (then the time to fill the cap at the arrival rate, within half the SLO,
    since only a longer wait makes Ray's batches bigger). Inside [min_ms, max_ms]."""
    lo, hi = spec.wait.min_ms / 1000.0, spec.wait.max_ms / 1000.0
    if plan is not None:
        w = plan.wait_s
    elif backlog and units_per_s > 0:
        w = max(current_s, min(max(0.0, cap - unit_per_request) / units_per_s, slo_ms / 2000.0))
    else:
        w = current_s
    return min(hi, max(lo, w))


def decide_batch(load: ModelLoad, spec: ModelSpec, cap: int, wait_s: float, fit: LatencyFit | None, gpu: GpuLoad, ctx: RuleContext) -> BatchWant:
    ctl = spec.control
    floor, ceiling = spec.batch.floor, spec.batch.ceiling
    # fast attack, slow decay: a burst (the last couple of reports well over the window's rate)
    # is taken at once; ordinary report-to-report noise is not (it would make the wait jitter)
    rate_rps = load.arrival_rate_rps
    if load.recent_arrival_rate_rps > BURST_FACTOR * load.arrival_rate_rps:
        rate_rps = load.recent_arrival_rate_rps
    units_per_s = rate_rps * max(load.cost_per_request, 1e-9) / max(1, load.replicas)
    queued_units = load.queue_depth * max(load.cost_per_request, 1.0) / max(1, load.replicas)

    u = max(load.cost_per_request, 1.0)
    plan = None
    if fit is not None and units_per_s > 0:
        # A backlog (more than a batch queued) drains only with spare capacity: plan bigger
        # batches (utilisation at most DRAIN_RHO) until it is gone.
        draining = load.queue_depth / max(1, load.replicas) > ctl.band_high and queued_units > cap
        plan = plan_batch(fit, units_per_s, u, ctx.slo_ms, ctx.objective, ceiling, DRAIN_RHO if draining else None,
                          ctx.formation)

    def want(new_cap: float, trigger: str, value: float, rule: str, reason: str, *, safety: bool = False, admit: bool = True) -> BatchWant:
        new = max(1, int(round(new_cap)))
        backlog = load.queue_depth / max(1, load.replicas) > ctl.band_high
        wait = wait_for(plan, max(new, 1), units_per_s, u, ctx.slo_ms, spec, wait_s, backlog)
        return BatchWant(new, wait, admit, trigger, float(value), rule, reason, safety)

    if ctl.strategy == "static":
        return BatchWant(cap, wait_s, True, "static", float(cap), "static", f"static strategy holds batch {cap}")

    # 1. memory emergency: halve now, never under the floor
    if gpu.free_frac < ctx.emergency_free_frac or load.emergency:
        new = max(floor, min(cap // 2, int(queued_units // 2)))
        admit = gpu.free_frac >= ctx.emergency_free_frac / 2.0
        why = f"free_frac {gpu.free_frac:.3f} < {ctx.emergency_free_frac}" if gpu.free_frac < ctx.emergency_free_frac else "replica reported an emergency shrink"
        what = f"{why}: halve batch {cap}->{new}"
        if not admit and ctx.paused_for_s >= ctx.max_pause_s:
            admit = True  # bounded pause: re-open at the floor (the replica's fast loop still guards each batch)
            what += f", re-open admission after {ctx.paused_for_s:.0f}s paused"
        elif not admit:
            what += ", pause admission"
        return want(new, "free_frac", gpu.free_frac, "emergency", what, safety=True, admit=admit)

    # The AIMD reacts to the recent P95 (rate window, a few seconds, never one sample); the
    # 30 s window P95 would keep "breaching" long after a transient and shrink too far.
    p95 = load.recent_p95_ms if load.recent_samples >= ctl.min_samples else None
    enough = p95 is not None
    target = b_lat = None
    if plan is not None:
        target, b_lat = plan.cap, plan.b_lat

    # 2. P95 near the cap
    if enough and p95 > ctl.p95_near_frac * ctx.slo_ms:
        # Queueing (a backlog of more than one batch, or arrivals beyond what this cap serves)
        # means the latency comes from too little throughput: shrinking would make it worse.
        overloaded = fit is not None and units_per_s > 0.95 * fit.saturated_rate(cap)
        backlog = queued_units > cap or load.queue_depth / max(1, load.replicas) > ctl.band_high or overloaded
        if backlog:
            if target is not None and target > cap:
                return want(target, "p95_ms", p95, "p95", f"p95_ms {p95:.1f} > {ctl.p95_near_frac:g}x cap {ctx.slo_ms:.0f} with a backlog ({queued_units:.0f} queued, arrivals {units_per_s:.1f}/s): grow {cap}->{int(round(target))}", safety=True)
            if target is None and cap < ceiling:
                new = min(ceiling, cap * 2)
                return want(new, "p95_ms", p95, "p95", f"p95_ms {p95:.1f} > {ctl.p95_near_frac:g}x cap {ctx.slo_ms:.0f} with a backlog of {queued_units:.0f}: grow {cap}->{new}", safety=True)
        elif target is None or cap > target:
            # No backlog: the batch itself is too slow. With a latency model, only when the
            # model agrees the cap is over its target; else the high P95 is a draining
            # transient and the model rule below sets the cap.
            new = cap * ctl.aimd_backoff
            if target is not None:
                new = max(new, min(target, cap - 1))
            if b_lat is not None and b_lat >= floor:
                new = min(new, max(b_lat, target or 0))
            new = max(floor, math.floor(new))
            if new < cap:
                return want(new, "p95_ms", p95, "p95", f"p95_ms {p95:.1f} > {ctl.p95_near_frac:g}x cap {ctx.slo_ms:.0f} without a backlog: shrink {cap}->{new}", safety=True)

    # 3. idle: drop to the floor so the memory can be lent
    if ctx.idle_for_s >= ctl.idle_hold_s and load.queue_depth <= 0:
        if cap > floor:
            return want(floor, "arrival_rate_rps", load.arrival_rate_rps, "idle", f"no arrivals for {ctx.idle_for_s:.0f}s: batch {cap}->{floor}")
        return want(cap, "arrival_rate_rps", load.arrival_rate_rps, "hold", "idle at the floor")

    # 4. model-based jump
    if target is not None:
        new = min(target, cap + ctl.aimd_step) if ctx.recovering and target > cap else target
        rel = abs(new - cap) / max(cap, 1)
        wait_new = wait_for(plan, max(1, int(round(new))), units_per_s, u, ctx.slo_ms, spec, wait_s)
        wait_rel = abs(wait_new - wait_s) / max(wait_s, 1e-3)
        if (rel > 0.1 * ctx.band_scale and int(round(new)) != cap) or wait_rel > 0.2 * ctx.band_scale:
            rho = "overload" if not math.isfinite(plan.rho) else f"{plan.rho:.2f}"
            return want(new, "arrival_rate_rps", rate_rps, "model",
                        f"arrival_rate_rps {rate_rps:.1f} with L(b)={fit.a_ms:.1f}+{fit.c_ms:.3f}b ms: "
                        f"batch {plan.batch:.1f} at utilisation {rho} fills in {plan.wait_s * 1000:.1f} ms "
                        f"(est. P95 {plan.est_ms:.0f} ms): cap {cap}->{int(round(new))}, wait {wait_s * 1000:.1f}->{wait_new * 1000:.1f} ms")
        return BatchWant(cap, wait_s, True, "arrival_rate_rps", float(rate_rps), "hold",
                         f"arrival_rate_rps {rate_rps:.1f}: model plan within the dead band, hold batch {cap}")

    # 5. queue dead band (no latency model yet)
    qdepth = load.queue_depth / max(1, load.replicas)
    high, low = ctl.band_high * ctx.band_scale, ctl.band_low / ctx.band_scale
    if target is None:
        if qdepth > high:
            new = min(ceiling, cap * min(2.0, qdepth / max(ctl.target_queue, 1)))
            if ctx.recovering:
                new = min(new, cap + ctl.aimd_step)
            if int(new) > cap:
                return want(new, "queue_depth", qdepth, "queue", f"queue_depth {qdepth:.0f} > band top {high:.0f}: grow {cap}->{int(new)}")
        elif qdepth < low and load.arrival_rate_rps > 0 and cap > floor and enough and p95 < ctl.p95_low_frac * ctx.slo_ms:
            new = max(floor, int(cap * max(0.5, qdepth / max(ctl.target_queue, 1))))
            if new < cap:
                return want(new, "queue_depth", qdepth, "queue", f"queue_depth {qdepth:.0f} < band bottom {low:.0f}: shrink {cap}->{new}")

    # 6. SM utilisation: card idle for want of batch
    if gpu.sm_util_frac is not None and gpu.sm_util_frac < ctl.sm_low_frac and qdepth > 0 and cap < ceiling:
        new = cap + ctl.aimd_step
        return want(new, "sm_util_frac", gpu.sm_util_frac, "sm_util", f"sm_util_frac {gpu.sm_util_frac:.2f} < {ctl.sm_low_frac} with queue {qdepth:.0f}: grow {cap}->{new}")
    sm_busy = gpu.sm_util_frac is not None and gpu.sm_util_frac >= ctl.sm_high_frac

    # 7. additive growth with backlog while P95 is well under the cap
    if enough and p95 < ctl.p95_low_frac * ctx.slo_ms and qdepth >= 1 and cap < ceiling and not sm_busy and target is None:
        new = cap + ctl.aimd_step
        return want(new, "p95_ms", p95, "p95_low", f"p95_ms {p95:.1f} < {ctl.p95_low_frac:g}x cap with queue {qdepth:.0f}: grow {cap}->{new}")

    trigger, value = ("queue_depth", qdepth)
    return want(cap, trigger, value, "hold", f"queue_depth {qdepth:.0f} inside band [{low:.0f}, {high:.0f}]: hold {cap}")
