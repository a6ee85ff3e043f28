"""What every batch rule sees (``broker.control.batch_rules``): the tick's context and the inputs derived once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from broker.control.batch_plan import BatchPlan, wait_for
from broker.control.latency_model import LatencyFit
from broker.control.state import BatchWant
from broker.control.types import GpuLoad, ModelLoad
from broker.control.vocab import Rule, Trigger
from quotas.config import BatchSpec, ModelSpec


def cap_top(batch: BatchSpec, mem_cap: int | None) -> int:
    """The largest cap a model's replicas may run: its ceiling, or the batch its grant's memory
    holds (``MemoryModel.cap_for``) where that is lower, never under its floor."""
    return batch.ceiling if mem_cap is None or mem_cap >= batch.ceiling else max(batch.floor, mem_cap)


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
    mem_ceiling: int | None = None  # the batch the grant holds now (None: memory does not limit): the wait plans for it


@dataclass(frozen=True)
class Inputs:
    """What every rule sees: the load, the config, the context, and the numbers derived once."""

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
    # derived once by ``broker.control.batch_rules.inputs_for``: the rules ask these several times a tick
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
        backlog = self.qdepth > self.spec.control.band_high
        wait = wait_for(self.plan, new, self.units_per_s, self.u, self.ctx.slo_ms, self.spec, self.wait_s, backlog)
        return BatchWant(new, wait, admit, trigger, float(value), rule, reason, safety)

    def wanted_cap(self, new_cap: float) -> int:
        """The cap ``want`` asks for ``new_cap``: rounded, at least 1, grown no further than the plan's useful batch."""
        new = max(1, round(new_cap))
        if self.plan is not None and new > self.cap and math.isfinite(self.plan.useful):
            new = min(new, max(self.cap, math.ceil(self.plan.useful)))  # no rule grows a lazy cap past it
        return new

    def hold(self, trigger: Trigger, value: float, rule: Rule, reason: str) -> BatchWant:
        """Keep the cap and the wait as they are."""
        return BatchWant(self.cap, self.wait_s, True, trigger, float(value), rule, reason)
