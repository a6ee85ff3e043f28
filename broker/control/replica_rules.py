"""Replica targets under price profiles: fewer instances when larger batches carry the load.

At peak (``throughput``) a model plans larger batches, each paying L(b)'s fixed cost once for
more requests, so fewer replicas carry its rate. ``n`` replicas carry it when the batch planned at
utilisation ``RHO_MAX`` exists, fits the grant's cap and keeps fill time + 2 L(b) within the SLO;
carrying is monotone in ``n``, so the target is the fewest that carry. Rules, first match wins
(``RULES``): ``replicas_configured`` (another objective, or no fit), ``replicas_raise`` (at once),
``replicas_lower`` (with ``lower_margin_frac`` to spare for ``lower_after_s``), ``replicas_hold``.
Pure (time is ``now_s``); ``[min_replicas, configured]`` is applied in one place, ``_clamp``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum

from gpubroker.broker.control.latency_model import LatencyFit
from gpubroker.broker.control.profiles import RHO_MAX

THROUGHPUT = "throughput"
LOWER_AFTER_WINDOWS = 2.0  # a lower waits this many rate windows (control.window_s) of carried load
LOWER_MARGIN_FRAC = 0.2  # a lower count must carry the rate x (1 + this)


class ReplicaRule(StrEnum):
    """A row of ``RULES`` (the decision log's ``rule`` for a replica target)."""

    CONFIGURED = "replicas_configured"  # objective not throughput (or no fit): the configured count
    RAISE = "replicas_raise"  # the target does not carry the load: raise at once
    LOWER = "replicas_lower"  # fewer replicas carried the load for lower_after_s: lower
    HOLD = "replicas_hold"  # keep the target


class ReplicaTrigger(StrEnum):
    """The metric behind a replica decision (the decision log's ``trigger``)."""

    OBJECTIVE = "objective"  # the active profile's objective (value: the configured count)
    ARRIVAL_RATE_RPS = "arrival_rate_rps"  # the model's arrival rate on the card


@dataclass(frozen=True)
class ReplicaParams:
    """The hysteresis. ``lower_after_s``: how long a lower count must carry the load before the
    target drops; ``lower_margin_frac``: the spare rate it must carry; ``min_replicas``: floor."""

    lower_after_s: float = 30.0
    lower_margin_frac: float = LOWER_MARGIN_FRAC
    min_replicas: int = 1

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be at least 1; a model needs a replica")
        if self.lower_after_s < 0 or self.lower_margin_frac < 0:
            raise ValueError(
                f"lower_after_s ({self.lower_after_s}) and lower_margin_frac ({self.lower_margin_frac}) must be >= 0"
            )


@dataclass(frozen=True)
class ReplicaInputs:
    """One model on one card, this tick."""

    now_s: float
    configured: int  # ModelSpec.replicas on this card: the most the target may be
    live: int  # replicas that reported in the window
    objective: str  # the active profile's objective
    arrival_rate_rps: float  # requests per second to the model on this card
    unit_per_request: float  # batch units per request (1 for requests, tokens per request)
    fit: LatencyFit | None  # the latency model L(b) = a + c*b (None: none yet)
    batch_cap: int  # largest batch a replica may run: the ceiling, cut by the grant's memory ceiling
    slo_ms: float  # effective P95 cap (SLO x profile slack)


@dataclass(frozen=True)
class ReplicaState:
    """Between ticks: the target and the lower spell in progress."""

    target: int
    lower_since_s: float | None = None  # start of the spell a lower count has carried the load
    lower_want: int = 0  # the highest lower count wanted during that spell


@dataclass(frozen=True)
class ReplicaDecision:
    target: int  # the replica target after this tick
    old: int  # the target before it
    rule: ReplicaRule
    trigger: ReplicaTrigger
    trigger_value: float
    reason: str
    needed: int  # the fewest replicas that carry the rate now (configured when none does)

    @property
    def changed(self) -> bool:
        return self.target != self.old


@dataclass(frozen=True)
class ReplicaChange:
    """A model whose target changed this tick, with what the rule read (for its log entry)."""

    model: str
    inputs: ReplicaInputs
    decision: ReplicaDecision


def planned_batch(fit: LatencyFit, units_per_s: float, unit_per_request: float, rho: float) -> float | None:
    """The batch that runs one replica at utilisation ``rho`` at this rate (None: no batch does)."""
    lam = units_per_s / 1000.0  # units per ms
    u = max(unit_per_request, 1.0)
    if lam <= 0:
        return u
    if rho <= lam * fit.c_ms:
        return None
    return max(u, lam * fit.a_ms / (rho - lam * fit.c_ms))


def carries(inp: ReplicaInputs, n: int, rate_factor: float = 1.0) -> bool:
    """``n`` replicas carry the rate: the planned batch exists, fits the cap and the SLO."""
    if inp.fit is None or n < 1:
        return False
    u = max(inp.unit_per_request, 1.0)
    units_per_s = inp.arrival_rate_rps * rate_factor * u / n
    if units_per_s <= 0:
        return True
    b = planned_batch(inp.fit, units_per_s, u, RHO_MAX[THROUGHPUT])
    if b is None or b > inp.batch_cap:
        return False
    fill_ms = (b - u) / (units_per_s / 1000.0)
    return fill_ms + 2.0 * inp.fit.predict_ms(b) <= inp.slo_ms


def needed(inp: ReplicaInputs, params: ReplicaParams, rate_factor: float = 1.0) -> int:
    """The fewest replicas in ``[min_replicas, configured]`` that carry the rate (configured when none)."""
    for n in range(_floor(inp, params), inp.configured + 1):
        if carries(inp, n, rate_factor):
            return n
    return inp.configured


def _floor(inp: ReplicaInputs, params: ReplicaParams) -> int:
    return min(params.min_replicas, inp.configured)


def _clamp(n: int, inp: ReplicaInputs, params: ReplicaParams) -> int:
    """The one guard-rail: ``min_replicas <= target <= configured``."""
    return max(_floor(inp, params), min(inp.configured, n))


def _rate_text(inp: ReplicaInputs) -> str:
    return f"{inp.arrival_rate_rps:.2f} req/s"


# ------------------------------------------------------------------------------ the rules
_Rule = Callable[[ReplicaInputs, ReplicaState, ReplicaParams], "tuple[ReplicaDecision, ReplicaState] | None"]


def configured(
    inp: ReplicaInputs, st: ReplicaState, params: ReplicaParams
) -> tuple[ReplicaDecision, ReplicaState] | None:
    if inp.objective == THROUGHPUT and inp.fit is not None:
        return None
    why = f"objective {inp.objective}" if inp.objective != THROUGHPUT else "no latency fit yet"
    d = ReplicaDecision(
        inp.configured,
        st.target,
        ReplicaRule.CONFIGURED,
        ReplicaTrigger.OBJECTIVE,
        float(inp.configured),
        f"{why}: the configured {inp.configured} replica(s)",
        inp.configured,
    )
    return d, ReplicaState(inp.configured)


def raise_now(
    inp: ReplicaInputs, st: ReplicaState, params: ReplicaParams
) -> tuple[ReplicaDecision, ReplicaState] | None:
    need = needed(inp, params)
    if need <= st.target:
        return None
    new = _clamp(need, inp, params)
    why = (
        f"{st.target} replica(s) do not carry {_rate_text(inp)} at utilisation {RHO_MAX[THROUGHPUT]:g} "
        f"within batch {inp.batch_cap} and SLO {inp.slo_ms:.0f} ms: raise to {new}"
    )
    return ReplicaDecision(
        new, st.target, ReplicaRule.RAISE, ReplicaTrigger.ARRIVAL_RATE_RPS, inp.arrival_rate_rps, why, need
    ), ReplicaState(new)


def lower_later(
    inp: ReplicaInputs, st: ReplicaState, params: ReplicaParams
) -> tuple[ReplicaDecision, ReplicaState] | None:
    low = _clamp(needed(inp, params, 1.0 + params.lower_margin_frac), inp, params)
    if low >= st.target or inp.live < st.target:
        return None
    spell = st.lower_since_s is not None
    since = st.lower_since_s if st.lower_since_s is not None else inp.now_s
    want = max(st.lower_want, low) if spell else low
    need = needed(inp, params)
    held_s = inp.now_s - since
    if held_s + 1e-9 < params.lower_after_s:
        why = (
            f"{want} replica(s) carry {_rate_text(inp)} for {held_s:.1f}s < {params.lower_after_s:g}s: hold {st.target}"
        )
        return ReplicaDecision(
            st.target, st.target, ReplicaRule.HOLD, ReplicaTrigger.ARRIVAL_RATE_RPS, inp.arrival_rate_rps, why, need
        ), ReplicaState(st.target, since, want)
    why = (
        f"larger batches carry {_rate_text(inp)} on {want} replica(s) (utilisation {RHO_MAX[THROUGHPUT]:g}, "
        f"batch <= {inp.batch_cap}, SLO {inp.slo_ms:.0f} ms) for {held_s:.1f}s: lower {st.target}->{want}"
    )
    return ReplicaDecision(
        want, st.target, ReplicaRule.LOWER, ReplicaTrigger.ARRIVAL_RATE_RPS, inp.arrival_rate_rps, why, need
    ), ReplicaState(want)


def hold(inp: ReplicaInputs, st: ReplicaState, params: ReplicaParams) -> tuple[ReplicaDecision, ReplicaState]:
    need = needed(inp, params)
    why = f"{st.target} replica(s) for {_rate_text(inp)} (fewest that carry it: {need})"
    if inp.live < st.target:
        why += f"; {inp.live} live, waiting for the rest before any lower"
    return ReplicaDecision(
        st.target, st.target, ReplicaRule.HOLD, ReplicaTrigger.ARRIVAL_RATE_RPS, inp.arrival_rate_rps, why, need
    ), ReplicaState(st.target)


RULES: tuple[_Rule, ...] = (configured, raise_now, lower_later, hold)


def initial_state(configured_replicas: int) -> ReplicaState:
    """Before the first tick: the count the model was deployed with."""
    return ReplicaState(int(configured_replicas))


def decide(
    inp: ReplicaInputs, state: ReplicaState, params: ReplicaParams | None = None
) -> tuple[ReplicaDecision, ReplicaState]:
    """The first rule that answers. A state whose target is outside the bounds (the config's
    replicas changed) is clamped first."""
    params = params or ReplicaParams()
    if not math.isfinite(inp.arrival_rate_rps) or inp.arrival_rate_rps < 0:
        inp = replace(inp, arrival_rate_rps=0.0)
    if inp.configured < 1:
        raise ValueError(f"configured replicas ({inp.configured}) must be at least 1")
    given = state.target
    bounded = _clamp(given, inp, params)
    if bounded != given:
        state = replace(state, target=bounded)
    for rule in RULES:
        out = rule(inp, state, params)
        if out is not None:
            decision, new_state = out
            return (decision if bounded == given else replace(decision, old=given)), new_state
    raise AssertionError("the replica rules ended without an answer; their last rule must always answer")


__all__ = [
    "RULES",
    "ReplicaChange",
    "ReplicaDecision",
    "ReplicaInputs",
    "ReplicaParams",
    "ReplicaRule",
    "ReplicaState",
    "ReplicaTrigger",
    "carries",
    "decide",
    "initial_state",
    "needed",
    "planned_batch",
]
