"""The latency model's batch plan: from L(b) = a + c*b and an arrival rate to a batch and wait.

Ray 2.60's ``@serve.batch`` forms batches eagerly, so under load the wait timeout, not the cap,
sets the batch size (with no wait a loaded replica saturates at 1/a); the cap bounds what a burst
may form. A batch b runs at utilisation ``lambda (a + c b) / b``: the plan picks the batch and the
wait that fills it with the lowest estimated P95. With lazy formation batches size themselves
(``lambda a / (1 - lambda c)``) and the plan keeps the wait short. Pure.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from gpubroker.broker.control.latency_model import LatencyFit
from gpubroker.broker.control.profiles import BATCH_HEADROOM, RHO_MAX

LAZY_WAIT_BUDGET_FRAC = {
    "latency": 0.1,
    "balanced": 0.25,
    "throughput": 0.5,
}  # share of the SLO budget a lazy wait may take, per objective
# A lazy cap stops where a bigger batch buys under 10 % more throughput (``useful_batch``).
USEFUL_THROUGHPUT_FRAC = 0.9


class PlanTarget(NamedTuple):
    """What a plan aims for: the latency cap, the profile's objective, how batches form, and the
    batches it may use."""

    slo_ms: float  # effective P95 cap
    objective: str  # throughput | latency | balanced
    ceiling: int  # the config's batch ceiling
    formation: str = "eager"  # how the runtime forms batches (broker.batch_formation)
    run_cap: int | None = None  # lazy: the batch the grant holds now (the wait plans for it)


class BatchPlan(NamedTuple):
    """What the latency model says for the current arrival rate (per replica)."""

    batch: float  # batch that keeps utilisation at ``rho`` (the batch the wait timeout fills)
    wait_s: float  # time to fill that batch at the arrival rate (before the config's clamp)
    rho: float  # utilisation aimed for (inf: the rate is beyond what any batch serves)
    b_lat: float  # largest batch with 2 L(b) <= cap (what a burst may form at most, latency-wise)
    est_ms: float  # estimated P95: wait + L(batch) + queueing
    cap: float  # batch cap: headroom over ``batch`` for bursts, at least b_lat, within the ceiling
    useful: float = math.inf  # lazy: the largest cap any rule may grow to (``useful_batch``, at least b_lat)


def _queue_ms(rho: float, service_ms: float, batch: float) -> float:
    """Wait for the executor, Kingman's G/D/1 approximation x 2 as a tail proxy. A batch closes
    a fixed wait after its first request, and that first request comes after an exponential
    gap, so batch inter-arrival CV^2 is about 1 / b^2: big batches arrive almost evenly."""
    ca2 = 1.0 / max(batch, 1.0) ** 2
    return 2.0 * rho / (1.0 - rho) * ca2 / 2.0 * service_ms


def useful_batch(fit: LatencyFit, frac: float = USEFUL_THROUGHPUT_FRAC) -> float:
    """The smallest batch whose throughput b / L(b) is ``frac`` of the curve's top, 1/c:
    b = frac / (1 - frac) * a / c. Past this batch a lazy batch only grows its latency (a nearly
    linear curve: 8 requests there; a = 20, c = 0.5 ms: 360, past any ceiling). Without the bound,
    a fit that says no batch keeps up sends the cap to the ceiling, the lazy gate lets in everything
    waiting, and batches run past the request timeout on a load small batches serve."""
    return math.inf if fit.c_ms <= 0 else frac / (1.0 - frac) * fit.a_ms / fit.c_ms


def plan_batch(
    fit: LatencyFit, units_per_s: float, unit_per_request: float, target: PlanTarget, rho_cap: float | None = None
) -> BatchPlan:
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
    slo_ms, objective, ceiling = target.slo_ms, target.objective, target.ceiling
    b_lat = fit.largest_batch_within(slo_ms / 2.0)
    if target.formation == "lazy":
        return _plan_lazy(fit, lam, u, b_lat, target)
    headroom = BATCH_HEADROOM.get(objective, 2.0)
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


def _plan_lazy(fit: LatencyFit, lam: float, u: float, b_lat: float, target: PlanTarget) -> BatchPlan:
    """Lazy formation (the next batch forms when the replica is free): batches size themselves
    to the load at the fixed point b = lambda a / (1 - lambda c), so no wait is needed under
    load; the cap leaves headroom for bursts, and a short wait (a share of the SLO budget left
    after two batches) only helps an idle replica gather a few requests."""
    slo_ms, objective, ceiling, run_cap = target.slo_ms, target.objective, target.ceiling, target.run_cap
    headroom = BATCH_HEADROOM.get(objective, 2.0)
    denom = 1.0 - lam * fit.c_ms
    b_fp = lam * fit.a_ms / denom if (lam > 0 and denom > 0) else (0.0 if lam <= 0 else math.inf)
    want = min(float(ceiling), b_fp * headroom) if math.isfinite(b_fp) else float(ceiling)
    useful = max(b_lat, useful_batch(fit), u)
    cap = min(float(ceiling), max(b_lat, min(want, useful), u))
    # the wait is for the batch that will run: the cap, or less where the grant holds less
    # (``run_cap``); the cap itself stays the load's want, so lending sees what the model needs
    runs = min(cap, float(run_cap)) if run_cap is not None and run_cap > 0 else cap
    budget_s = max(0.0, slo_ms - 2.0 * fit.predict_ms(runs)) / 1000.0 * LAZY_WAIT_BUDGET_FRAC.get(objective, 0.25)
    fill_s = runs / (lam * 1000.0) if lam > 0 else 0.0
    batch = max(u, b_fp) if math.isfinite(b_fp) else float(ceiling)
    rho = lam * fit.predict_ms(batch) / batch if math.isfinite(b_fp) and lam > 0 else (0.0 if lam <= 0 else math.inf)
    return BatchPlan(batch, min(fill_s, budget_s), rho, b_lat, 2.0 * fit.predict_ms(batch), cap, useful)
