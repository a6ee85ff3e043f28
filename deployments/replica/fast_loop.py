"""The replica's fast loop: one pure step per batch, from a memory reading to a local cap.

Between the broker's ticks the replica guards each batch: under ``emergency_free_frac`` it halves
its local cap (never below the floor), pauses admission when still short at the floor or critical,
and widens back by ``recover_step_frac`` per batch once headroom returns. A replica within its grant
on a short card (CUDA) is not to blame: it neither shrinks nor pauses. No reading, no change. The
replica and the simulator both call ``fast_loop_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gpubroker.quotas.config import FleetConfig, ModelSpec


class FastEvent(StrEnum):
    NONE = "none"
    SHRINK = "shrink"
    PAUSE = "pause"
    RECOVER = "recover"


@dataclass(frozen=True)
class FastLoopParams:
    floor: int  # batch floor (cost units)
    emergency_free_frac: float  # below this free share: halve
    critical_free_factor: float = 0.5  # below emergency x this (or at the floor): pause
    recover_step_frac: float = 0.125  # widen back by this share of the broker's cap per batch


@dataclass(frozen=True)
class FastLoopResult:
    cap: int  # the local cap to run the next batch with
    paused: bool  # admission paused by the fast loop
    event: FastEvent  # what happened (counted as an emergency on shrink and on a new pause)
    counted: bool  # does this step count as an emergency shrink in the report?


def params_for(spec: ModelSpec, config: FleetConfig) -> FastLoopParams:
    """The fast loop's parameters for one model, from its config (one place for the replica
    and the simulator)."""
    ctl = spec.control
    return FastLoopParams(
        floor=spec.batch.floor,
        emergency_free_frac=config.gpu.emergency_free_frac,
        critical_free_factor=getattr(ctl, "critical_free_factor", FastLoopParams.critical_free_factor),
        recover_step_frac=getattr(ctl, "recover_step_frac", FastLoopParams.recover_step_frac),
    )


def fast_loop_step(
    free_frac: float | None, cap: int, broker_cap: int, paused: bool, p: FastLoopParams, within_grant: bool = False
) -> FastLoopResult:
    """One step before a batch: ``cap`` is the local cap now, ``broker_cap`` the broker's;
    ``within_grant``: ``free_frac`` is the card's and this replica holds no more than its grant."""
    if free_frac is None:
        return FastLoopResult(cap, paused, FastEvent.NONE, False)
    if free_frac < p.emergency_free_frac and not within_grant:
        new_cap = max(p.floor, cap // 2)
        if new_cap < cap:
            return FastLoopResult(new_cap, paused, FastEvent.SHRINK, True)
        if free_frac < p.emergency_free_frac * p.critical_free_factor or cap <= p.floor:
            return FastLoopResult(cap, True, FastEvent.PAUSE, not paused)
        return FastLoopResult(cap, paused, FastEvent.NONE, False)
    target = max(1, broker_cap)
    if cap < target:
        new_cap = min(target, cap + max(1, int(target * p.recover_step_frac)))
        return FastLoopResult(new_cap, False, FastEvent.RECOVER, False)
    return FastLoopResult(cap, False, FastEvent.NONE, False)
