"""The request-batching kind: a model whose batches the broker sizes (batch cap and wait timeout).

Its step runs the batch rules (``gpubroker.broker.control.batch_rules``); its need is the grant its
wanted batch takes by its memory model; it is quiet when its replicas' busy share is low with no
backlog; it borrows only while its memory holds it back (``lending.pressed``) and only a loan that
raises its batch ceiling. Pure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from gpubroker.broker.control.batch_rules import decide_batch
from gpubroker.broker.control.lending import QuotaRound, lifts_ceiling, peak_batch, pressed
from gpubroker.broker.control.model_step import (
    NO_BOUNDS,
    KindBounds,
    ModelStep,
    TickView,
    WantInputs,
    rule_context,
    step_model,
)
from gpubroker.broker.control.state import BatchWant, ModelState
from gpubroker.broker.control.types import ModelLoad
from gpubroker.broker.wire import ModelSettings
from gpubroker.quotas.config import FleetConfig, ModelSpec
from gpubroker.quotas.ledger import QuotaLedger
from gpubroker.quotas.sizes import format_size

if TYPE_CHECKING:
    from gpubroker.broker.control.state import PolicyState


def settings_for(state: PolicyState, model: str, config: FleetConfig) -> ModelSettings:
    """A model's versioned settings in ``state`` (its batch, wait, grant, admission and reclaim flags)."""
    ms = state.models[model]
    return ModelSettings(
        model=model,
        version=ms.version,
        max_batch_size=ms.max_batch,
        batch_wait_timeout_s=ms.wait_s,
        grant_bytes=state.ledger.grant(model),
        admit=ms.admit,
        **quota_flags(state, model),
    )


class ReclaimFlags(TypedDict):
    """The reclaim escalation's fields of ``ModelSettings`` (its keyword arguments)."""

    release_cache: bool  # step 1 reached
    drain: bool  # step 2 reached
    restart_token: int  # bumped by step 3


def quota_flags(state: PolicyState, model: str) -> ReclaimFlags:
    """The reclaim escalation's settings for ``model`` (gpubroker.broker.control.lending, gpubroker.deployments.replica.reclaim)."""
    step = state.reclaim_steps.get(model, 0)
    return {"release_cache": step >= 1, "drain": step >= 2, "restart_token": state.restart_tokens.get(model, 0)}


def _quiet(load: ModelLoad, spec: ModelSpec, old: ModelState) -> bool:
    """Utilisation decides lending: quiet = busy share under idle_util_frac with no backlog; a
    replica refusing requests because it holds over its grant is not quiet (it wants memory)."""
    return load.busy_frac < spec.control.idle_util_frac and load.queue_depth <= 1 and not load.held_over


def _want(w: WantInputs) -> BatchWant:
    return decide_batch(w.load, w.spec, w.old.max_batch, w.old.wait_s, w.fit, w.view.snapshot.gpu, rule_context(w))


class BatchKind:
    """Request batching (``ModelKind``)."""

    def step(self, view: TickView, name: str, spec: ModelSpec) -> ModelStep:
        return step_model(view, name, spec, _quiet, _want)

    def need(self, r: QuotaRound, name: str) -> int | None:
        """The grant its wanted cap takes (None: not calibrated, it keeps its base)."""
        model = r.mm(name)
        if not model.calibrated:
            return None
        q = r.config.models[name].quota
        return min(q.max, max(q.min, r.replicas(name) * model.grant_for(r.inputs.wants[name].cap)))

    def working_set(self, r: QuotaRound, name: str) -> int:
        """Its memory in use now (latest reports, not the window's peak memory: a burst that ended
        20 s ago, served on borrowed memory, must not pin it for the next model's burst) times the
        margin, its min, the memory for a floor batch, and up to its base what its own demand at
        the window's peak needs (``peak_batch``). A lender still above a lowered grant is not
        confirmed until it is measured under it (two-phase)."""
        spec, load, mm = r.config.models[name], r.loads[name], r.mm(name)
        ws = max(int(load.mem_used_bytes * spec.control.working_set_margin), spec.quota.min)
        if mm.calibrated:
            ws = max(ws, r.replicas(name) * mm.grant_for(spec.batch.floor))
            peak = r.replicas(name) * mm.grant_for(peak_batch(load, spec, r.inputs.states[name].latency_fit))
            ws = max(ws, min(spec.quota.base, peak))
        return ws

    def idle(self, r: QuotaRound, name: str) -> bool:
        """Quiet for its idle hold (longer for a model whose loans keep coming back soon after it lends)."""
        return r.quiet_for(name, r.config.models[name].control.idle_hold_s * r.scale.get(name, 1.0))

    def hands_over(self, r: QuotaRound, name: str) -> bool:
        return False

    def reclaims(self, r: QuotaRound, owner: str) -> bool:
        return True

    def reclaim_hold(self, r: QuotaRound, owner: str, spec: ModelSpec) -> float:
        """``reclaim_hold_s``: it keeps a clump of stray requests from pulling memory back."""
        return spec.control.reclaim_hold_s

    def wants_why(self, r: QuotaRound, name: str, wanted: int) -> str:
        w = r.inputs.wants[name]
        return (
            f"{name} wants batch {w.cap} ({w.trigger} {w.value:.1f}) needing {format_size(wanted)}, "
            f"grant {format_size(r.ledger.grant(name))}"
        )

    def borrow_reason(self, r: QuotaRound, name: str, why: str) -> str | None:
        """Only while its memory holds it back (``pressed``)."""
        load = r.loads[name]
        ceiling = r.mm(name).cap_for(r.holds(name) / r.replicas(name))
        if pressed(load, r.config.models[name], ceiling, r.inputs.states[name].latency_fit) is not None:
            return None
        return why + (
            f", refusing requests: it holds {format_size(load.mem_used_bytes)}, over its grant"
            if load.held_over
            else f", behind at its memory ceiling {ceiling} (queue {load.queue_depth:.0f}, recent P95 "
            f"{load.recent_p95_ms or 0.0:.0f} ms)"
        )

    def loan_buys(self, r: QuotaRound, name: str, offers: list[tuple[str, int]]) -> bool:
        """A loan that would not raise its batch buys nothing (one refusing requests takes it)."""
        return r.loads[name].held_over or lifts_ceiling(r, name, offers)

    def settings(self, state: PolicyState, name: str, config: FleetConfig) -> ModelSettings:
        return settings_for(state, name, config)

    def bounds(self, view: TickView, name: str, spec: ModelSpec, ledger: QuotaLedger) -> KindBounds:
        return NO_BOUNDS


BATCH = BatchKind()
