"""Per-model batch rules: from one model's load to a wanted batch cap and wait timeout.

Design note. A request waits for the batch in flight and then runs in its own, so with
``L(b) = a + c*b`` and no wait timeout a replica's batches size themselves to the load: the
fixed point ``b_fp = lambda*a / (1 - lambda*c)``. The cap therefore matters in two places:
in a burst (a larger cap drains the queue in fewer fixed costs) and for memory and the
neighbours on the card (a larger batch holds more memory and more GPU time). The rules:

- ``emergency``: free memory under ``gpu.emergency_free_frac`` (or the replica's fast loop
  shrank): cap = max(floor, min(cap/2, queued/2)); admission pauses below half of it.
- ``p95``: recent P95 (the rate window, a few seconds) near the cap (``p95_near_frac``). With
  a backlog (more than a batch queued, or arrivals beyond what the cap serves) the latency
  is queueing: grow toward the throughput target. Without one, the batch itself is too slow:
  shrink multiplicatively (``aimd_backoff``) -- with a latency model only when the model also
  puts the cap above its target, since otherwise the P95 is a transient that is draining.
- ``idle``: no arrivals for ``idle_hold_s``: go to the floor (that is what lets it lend memory).
- ``model``: with a fitted L(b) and an arrival rate, cap = max(b_lat, headroom * b_fp) where
  ``b_lat`` is the largest batch with 2 L(b) <= cap; the headroom depends on the objective.
  Only moves when the change is over the (oscillation-widened) relative dead band.
- ``queue``: no fit yet: above the dead band's top scale up in proportion, below its bottom
  scale down, inside hold.
- ``sm_util``: SM utilisation under ``sm_low_frac`` with work waiting: grow by a step.
- ``p95_low``: P95 well under the cap with backlog: grow by ``aimd_step``.

The wait timeout is the time to fill the wanted batch at the arrival rate, capped by a share
(per objective) of the SLO budget left after two batch latencies, inside [min_ms, max_ms].

Everything here is pure; guard-rails (floor, ceiling, memory ceiling) are applied by the
caller in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from broker.latency_model import LatencyFit
from broker.profiles import BATCH_HEADROOM, WAIT_BUDGET_FRAC
from broker.types import GpuLoad, ModelLoad
from quotas.config import ModelSpec


@dataclass(frozen=True)
class BatchWant:
    cap: int  # wanted batch cap before guard-rails
    wait_s: float  # wanted wait timeout (already inside [min_ms, max_ms])
    admit: bool
    trigger: str  # metric that drove it
    value: float  # its value
    rule: str  # rule name
    reason: str  # human explanation
    safety: bool = False  # emergency / breach: bypasses the anti-oscillation hold


@dataclass(frozen=True)
class RuleContext:
    now_s: float
    slo_ms: float  # effective P95 cap (SLO x profile slack)
    objective: str  # throughput | latency | balanced
    emergency_free_frac: float
    band_scale: float  # >= 1, widened by anti-oscillation
    idle_for_s: float  # how long the model has had no arrivals (0 when busy)
    recovering: bool  # an emergency happened recently: grow only by steps


def _fixed_point_batch(fit: LatencyFit, units_per_s: float) -> float:
    """Self-sizing batch at this arrival rate (inf when the rate exceeds 1/c)."""
    lam = units_per_s / 1000.0  # per ms
    if lam <= 0:
        return 0.0
    denom = 1.0 - lam * fit.c_ms
    return math.inf if denom <= 0 else lam * fit.a_ms / denom


def model_target(fit: LatencyFit, units_per_s: float, slo_ms: float, objective: str, ceiling: int) -> tuple[float, float, float]:
    """(target, b_lat, b_fp) from the latency model."""
    b_lat = fit.largest_batch_within(slo_ms / 2.0)
    b_fp = _fixed_point_batch(fit, units_per_s)
    headroom = BATCH_HEADROOM.get(objective, 2.0)
    want = min(float(ceiling), b_fp * headroom) if math.isfinite(b_fp) else float(ceiling)
    return min(float(ceiling), max(b_lat, want)), b_lat, b_fp


def wait_for(fit: LatencyFit | None, cap: int, units_per_s: float, slo_ms: float, spec: ModelSpec, objective: str, current_s: float) -> float:
    lo, hi = spec.wait.min_ms / 1000.0, spec.wait.max_ms / 1000.0
    if fit is None:
        return min(hi, max(lo, current_s))
    budget_s = max(0.0, slo_ms - 2.0 * fit.predict_ms(cap)) / 1000.0 * WAIT_BUDGET_FRAC.get(objective, 0.25)
    fill_s = cap / units_per_s if units_per_s > 0 else math.inf
    return min(hi, max(lo, min(fill_s, budget_s)))


def decide_batch(load: ModelLoad, spec: ModelSpec, cap: int, wait_s: float, fit: LatencyFit | None, gpu: GpuLoad, ctx: RuleContext) -> BatchWant:
    ctl = spec.control
    floor, ceiling = spec.batch.floor, spec.batch.ceiling
    units_per_s = load.arrival_rate_rps * max(load.cost_per_request, 1e-9) / max(1, load.replicas)
    queued_units = load.queue_depth * max(load.cost_per_request, 1.0) / max(1, load.replicas)

    def want(new_cap: float, trigger: str, value: float, rule: str, reason: str, *, safety: bool = False, admit: bool = True) -> BatchWant:
        new = max(1, int(round(new_cap)))
        wait = wait_for(fit, max(new, 1), units_per_s, ctx.slo_ms, spec, ctx.objective, wait_s)
        return BatchWant(new, wait, admit, trigger, float(value), rule, reason, safety)

    if ctl.strategy == "static":
        return BatchWant(cap, wait_s, True, "static", float(cap), "static", f"static strategy holds batch {cap}")

    # 1. memory emergency: halve now, never under the floor
    if gpu.free_frac < ctx.emergency_free_frac or load.emergency:
        new = max(floor, min(cap // 2, int(queued_units // 2)))
        admit = gpu.free_frac >= ctx.emergency_free_frac / 2.0
        why = f"free_frac {gpu.free_frac:.3f} < {ctx.emergency_free_frac}" if gpu.free_frac < ctx.emergency_free_frac else "replica reported an emergency shrink"
        return want(new, "free_frac", gpu.free_frac, "emergency", f"{why}: halve batch {cap}->{new}" + ("" if admit else ", pause admission"), safety=True, admit=admit)

    # The AIMD reacts to the recent P95 (rate window, a few seconds, never one sample); the
    # 30 s window P95 would keep "breaching" long after a transient and shrink too far.
    p95 = load.recent_p95_ms if load.recent_samples >= ctl.min_samples else None
    enough = p95 is not None
    target = b_lat = b_fp = None
    if fit is not None and (units_per_s > 0 or queued_units > 0):
        target, b_lat, b_fp = model_target(fit, max(units_per_s, 1e-9), ctx.slo_ms, ctx.objective, ceiling)

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
        if rel > 0.1 * ctx.band_scale and int(round(new)) != cap:
            fp = "inf" if not math.isfinite(b_fp) else f"{b_fp:.1f}"
            return want(new, "arrival_rate_rps", load.arrival_rate_rps, "model",
                        f"arrival_rate_rps {load.arrival_rate_rps:.1f} with L(b)={fit.a_ms:.1f}+{fit.c_ms:.3f}b ms "
                        f"(fixed point {fp}, latency-fit {b_lat:.1f}): batch {cap}->{int(round(new))}")

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
