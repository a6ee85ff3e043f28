"""The policy's state and the per-model values shared by the rules, the kinds and the lending planner.

``BatchWant`` (what a model's rules want, before guard-rails), ``ModelState`` (one model's policy
state between ticks) and ``PolicyState`` (the whole policy's, checkpointed) live here so that the
kinds and ``gpubroker.broker.control.lending`` can take them without importing
``gpubroker.broker.control.policy`` (which imports them). The first two are named tuples:
immutable, and a tick builds one or two of each per model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gpubroker.broker.control.latency_model import LatencyFit
from gpubroker.broker.control.llm_rules import EngineRecord
from gpubroker.broker.control.replica_rules import ReplicaState
from gpubroker.broker.control.vocab import Rule, Trigger
from gpubroker.quotas.ledger import QuotaLedger


class BatchWant(NamedTuple):
    cap: int  # wanted batch cap before guard-rails
    wait_s: float  # wanted wait timeout (already inside [min_ms, max_ms])
    admit: bool
    trigger: Trigger  # metric that drove it
    value: float  # its value
    rule: Rule  # rule name
    reason: str  # human explanation
    safety: bool = False  # emergency / breach: bypasses the anti-oscillation hold


class ModelState(NamedTuple):
    max_batch: int
    wait_s: float
    admit: bool = True
    version: int = 1
    last_dir: int = 0  # direction of the last cap change: -1, 0, +1
    last_change_s: float = float("-inf")
    reversals: tuple[float, ...] = ()  # times of direction reversals (pruned to the window)
    band_scale: float = 1.0  # dead band widening factor from anti-oscillation
    hold_s: float = 0.0  # minimum time between non-safety changes
    last_reversal_s: float = float("-inf")
    last_arrival_s: float | None = None  # last tick that saw arrivals or queue
    loaded_since_s: float | None = None  # start of the current busy spell (for reclaim hysteresis)
    quiet_since_s: float | None = None  # start of the current low-utilisation spell (for lending)
    emergency_s: float = float("-inf")  # last memory emergency
    paused_since_s: float | None = None  # admission paused since (None: admitting)
    fit: tuple[float, float, int] | None = None  # (a_ms, c_ms, samples) of the latency model

    @property
    def latency_fit(self) -> LatencyFit | None:
        return None if self.fit is None else LatencyFit(*self.fit)

    def evolved(self, **changes: Any) -> ModelState:
        """A copy with ``changes`` (unknown names are refused)."""
        return self._replace(**changes)


@dataclass(frozen=True)
class PolicyState:
    models: Mapping[str, ModelState]
    ledger: QuotaLedger
    profile: str = ""
    tick: int = 0
    # donor -> settings version the donor must run before its pending transfers may complete
    confirm_after: Mapping[str, int] = field(default_factory=dict)
    # reclaim escalation (gpubroker.broker.control.lending): borrower -> step reached; model -> restart token
    reclaim_steps: Mapping[str, int] = field(default_factory=dict)
    restart_tokens: Mapping[str, int] = field(default_factory=dict)
    lend_scale: Mapping[str, float] = field(default_factory=dict)  # model -> idle-hold multiplier (lend regret)
    lent_at: Mapping[str, float] = field(default_factory=dict)  # model -> when it last lent
    engines: Mapping[str, EngineRecord] = field(default_factory=dict)  # kind: llm -> its rules' last decision
    # model -> its replica target and the lower spell in progress (gpubroker.broker.control.replica_targets);
    # not checkpointed: a restarted broker starts from the configured counts
    replicas: Mapping[str, ReplicaState] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "models": {name: _state_to_dict(s) for name, s in self.models.items()},
            "ledger": self.ledger.to_dict(),
            "profile": self.profile,
            "tick": self.tick,
            "confirm_after": dict(self.confirm_after),
            "reclaim_steps": dict(self.reclaim_steps),
            "restart_tokens": dict(self.restart_tokens),
            "lend_scale": dict(self.lend_scale),
            "lent_at": dict(self.lent_at),
            "engines": {name: e.to_dict() for name, e in self.engines.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PolicyState:
        models = {}
        for name, raw in data["models"].items():
            raw = dict(raw)
            raw["reversals"] = tuple(raw.get("reversals", ()))
            if raw.get("fit") is not None:
                raw["fit"] = tuple(raw["fit"])
            for key in ("last_change_s", "last_reversal_s", "emergency_s"):
                if raw.get(key) is None:
                    raw[key] = float("-inf")
            models[name] = ModelState(**raw)
        return cls(
            models=models,
            ledger=QuotaLedger.from_dict(data["ledger"]),
            profile=data.get("profile", ""),
            tick=int(data.get("tick", 0)),
            confirm_after={k: int(v) for k, v in data.get("confirm_after", {}).items()},
            reclaim_steps={k: int(v) for k, v in data.get("reclaim_steps", {}).items()},
            restart_tokens={k: int(v) for k, v in data.get("restart_tokens", {}).items()},
            lend_scale={k: float(v) for k, v in data.get("lend_scale", {}).items()},
            lent_at={k: float(v) for k, v in data.get("lent_at", {}).items()},
            engines={k: EngineRecord.from_dict(v) for k, v in data.get("engines", {}).items()},
        )


def _state_to_dict(state: ModelState) -> dict[str, Any]:
    out = state._asdict()
    for key in ("last_change_s", "last_reversal_s", "emergency_s"):
        if out[key] == float("-inf"):
            out[key] = None  # JSON has no -inf
    return out
