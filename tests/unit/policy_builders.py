"""Override builders and a fake clock for pure policy tests (STYLE.md items 4 and 13)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from gpubroker.broker.control.llm_rules import EngineRecord, LlmDecision, LlmRule, LlmState, LlmTrigger
from gpubroker.broker.control.policy import PolicyState, decide, initial_state
from gpubroker.broker.control.types import FleetDecision, FleetSnapshot, GpuLoad, ModelLoad, ReplicaSeen
from gpubroker.quotas.config import FleetConfig, parse_config

MiB = 1024**2
GiB = 1024**3
# Monday 2026-11-30 00:00:00 UTC
MONDAY_UTC = 1_795_996_800.0

BASE_CONFIG: dict[str, Any] = {
    "broker": {"control_interval_s": 1.0, "report_interval_s": 0.5},
    "gpu": {"device": "cpu", "capacity": "10GiB", "reserve_frac": 0.1, "emergency_free_frac": 0.10},
    "models": {
        "a": {
            "model": "profiled",
            "quota": {"min": "1GiB", "base": "3GiB", "max": "6GiB"},
            "batch": {"floor": 2, "ceiling": 128, "initial": 8},
            "slo_p95_ms": 100,
            "control": {"idle_hold_s": 5, "reclaim_hold_s": 2, "min_samples": 20},
        },
        "b": {
            "model": "profiled",
            "quota": {"min": "1GiB", "base": "3GiB", "max": "6GiB"},
            "batch": {"floor": 2, "ceiling": 128, "initial": 8},
            "slo_p95_ms": 100,
            "control": {"idle_hold_s": 5, "reclaim_hold_s": 2, "min_samples": 20},
        },
    },
}


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def make_config(**overrides: Any) -> FleetConfig:
    return parse_config(deep_merge(BASE_CONFIG, overrides))


def load(name: str, **kw: Any) -> ModelLoad:
    kw.setdefault("replicas", 1)
    return ModelLoad(name=name, **kw)


def replicas_seen(l: ModelLoad, now_s: float) -> tuple[ReplicaSeen, ...]:
    """One report per replica of ``l``, received at ``now_s``, splitting its memory evenly."""
    per = l.mem_used_bytes // max(1, l.replicas)
    return tuple(ReplicaSeen(f"{l.name}-r{i}", now_s, l.settings_version, per) for i in range(l.replicas))


def timings(a_ms: float, c_ms: float, sizes=(2, 4, 8, 16, 32)) -> tuple[tuple[float, float], ...]:
    """Exact L(b) = a + c*b samples for the latency fit."""
    return tuple((float(b), a_ms + c_ms * b) for b in sizes for _ in range(4))


def gpu(free_frac: float = 0.5, capacity: int = 10 * GiB, usable: int = 9 * GiB, sm: float | None = None) -> GpuLoad:
    return GpuLoad(
        capacity_bytes=capacity,
        usable_bytes=usable,
        used_bytes=int(capacity * (1 - free_frac)),
        free_frac=free_frac,
        sm_util_frac=sm,
    )


def with_engine_needs(state: PolicyState, need_bytes: dict[str, int]) -> PolicyState:
    """``state`` as if each engine's rules had last decided to want ``need_bytes`` (its other bounds
    as they were, or a small engine's)."""
    engines = dict(state.engines)
    for name, want in need_bytes.items():
        old = engines.get(name)
        decision = (
            replace(old.decision, want_grant_bytes=int(want))
            if old is not None
            else LlmDecision(8, 1024, 8, False, 8 * 256 * 1024, int(want), LlmRule.HOLD, LlmTrigger.HOLD, 0.0, "test")
        )
        engines[name] = EngineRecord(old.state if old else LlmState(8, 1024, 8), decision, str(decision.rule))
    return replace(state, engines=engines)


@dataclass
class FakeClock:
    """Integer ticks from a fixed epoch: float steps drift, integer ticks do not."""

    start_s: float = MONDAY_UTC + 12 * 3600
    tick: int = 0
    step_s: int = 1

    @property
    def now_s(self) -> float:
        return self.start_s + self.tick * self.step_s

    def advance(self, ticks: int = 1) -> float:
        self.tick += ticks
        return self.now_s


class Driver:
    """Runs decide() tick by tick the way the broker does, keeping state and the decisions."""

    def __init__(self, config: FleetConfig, usable: int = 9 * GiB, clock: FakeClock | None = None):
        self.config = config
        self.clock = clock or FakeClock()
        self.state: PolicyState = initial_state(config, usable)
        self.history: list[FleetDecision] = []

    def step(
        self,
        loads: dict[str, ModelLoad],
        gpu_load: GpuLoad | None = None,
        advance: int = 1,
        need_bytes: dict[str, int] | None = None,
    ) -> FleetDecision:
        """One tick; ``need_bytes``: LLM engines' wanted grants, as their rules would have decided
        them on the tick before (``with_engine_needs``)."""
        now = self.clock.advance(advance)
        full = {n: loads.get(n, load(n)) for n in self.config.models}
        # replicas report running the current settings unless the test says otherwise
        full = {
            n: (l if l.settings_version else replace(l, settings_version=self.state.models[n].version))
            for n, l in full.items()
        }
        # ... and each replica's report arrived just now (two-phase confirms need one per replica)
        full = {
            n: (l if l.replica_reports or not l.replicas else replace(l, replica_reports=replicas_seen(l, now)))
            for n, l in full.items()
        }
        snap = FleetSnapshot(now_s=now, gpu=gpu_load or gpu(), models=full)
        if need_bytes:
            self.state = with_engine_needs(self.state, need_bytes)
        decision, self.state = decide(snap, self.config, self.state)
        self.history.append(decision)
        self.state.ledger.check()
        return decision

    def cap(self, name: str) -> int:
        return self.state.models[name].max_batch

    def grant(self, name: str) -> int:
        return self.state.ledger.grant(name)
