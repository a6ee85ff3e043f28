"""Per-model values shared by the batch rules, the lending planner and the policy.

``BatchWant`` (what the batch rules want for one model, before guard-rails) and
``ModelState`` (one model's policy state between ticks) live here so that
``gpubroker.broker.control.lending`` can take them without importing ``gpubroker.broker.control.policy`` (which imports it).
Both are named tuples: immutable, and a tick builds one or two of each per model.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from gpubroker.broker.control.latency_model import LatencyFit
from gpubroker.broker.control.vocab import Rule, Trigger


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
