"""The load matrix: fleets, arrival processes and load levels that no rule was tuned on.

A cell is (fleet, arrival process, load level, seed). Seeds are drawn fresh for every run
(``fresh_seed``) and recorded with the cell, so no rule can be tuned on a fixed list of them.

- **Fleets** (``FLEETS``): one memory-bound model; three memory-bound models whose bursts come
  together; three whose bursts are staggered; a mix of compute-bound, memory-bound and tiny
  models; eight models on a card; three models with different SLOs. Every model's base is
  sized so that it holds a batch of exactly ``batch`` (weights + batch x bytes per item), and
  the card's usable memory is the sum of the bases (lending is the only way to a bigger batch).
- **Arrival processes** (``PROCESSES``): Poisson; gamma gaps with CV 2 and 4; on/off bursts;
  a diurnal ramp; the Azure trace's arrivals (``gpubroker.sim.arrivals``). On/off and diurnal
  take the fleet's phase: ``random`` (each model its own random burst times and lengths, which
  overlap), ``together`` (one schedule for every model) or ``staggered`` (the models take
  turns). The stationary processes ignore it.
- **Load levels** (``LEVELS``): a share of the fleet's capacity, computed from the profiles:
  model i's capacity is the back-to-back throughput of its static batch alone on the card,
  ``1000 B / (a + c B)`` req/s; the card is processor-shared, so the fleet at level L offers
  each of its n models ``L x capacity_i / n`` (the card at its static batches is busy a share L
  of the time). Above 1.0 only a bigger batch than the base holds can keep up.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpubroker.quotas.config import ConfigDoc
from gpubroker.sim import arrivals as arr

GIB = 1024**3
MIB = 1024**2
PROCESSES = ("poisson", "gamma:2", "gamma:4", "onoff", "diurnal", "trace")
MOVING = ("gamma:2", "gamma:4", "onoff", "diurnal")  # where load moves (the CV >= 2, on/off, diurnal)
LEVELS = (0.5, 0.8, 0.95, 1.1)
RESERVE_FRAC = 0.10  # the card's reserve; capacity = sum of bases / (1 - reserve)
OFF_SHARE = 0.2  # on/off: the rate between bursts, as a share of the mean
ON_MEAN_S, OFF_MEAN_S = 10.0, 20.0  # on/off (random phase): mean burst and gap lengths, exponential
SLOT_S = 15.0  # on/off staggered or together: each burst's length
DIURNAL_AMPLITUDE = 0.8  # diurnal: rate = mean x (1 + A sin(2 pi (t / duration + phase)))
DIURNAL_STEP_S = 5.0
WAIT_MAX_MS = 20.0  # every model's wait.max_ms: the longest batch wait the broker may set
SLO_BATCHES = 4.0  # a model's SLO: this many of its static batch's run times with the card shared n ways


@dataclass(frozen=True)
class ModelDef:
    """One model of a fleet: its profile, the batch its base holds, and its SLO's multiple."""

    name: str
    a_ms: float
    c_ms: float
    weights_mib: int
    item_mib: int
    batch: int  # the largest batch its base holds: the static batch a user would set
    ceiling: int
    slo_mult: float = 1.0  # heterogeneous SLOs: a multiple of the fleet's rule

    @property
    def base_bytes(self) -> int:
        return (self.weights_mib + self.batch * self.item_mib) * MIB

    def capacity_rps(self) -> float:
        """Back-to-back throughput of its static batch alone on the card."""
        return 1000.0 * self.batch / (self.a_ms + self.c_ms * self.batch)

    def slo_ms(self, n_models: int) -> float:
        return round(SLO_BATCHES * self.slo_mult * n_models * (self.a_ms + self.c_ms * self.batch), 1)


def _mem(name: str, slo_mult: float = 1.0) -> ModelDef:
    """Memory-bound: a large fixed cost per batch, so a bigger batch than the base holds pays."""
    return ModelDef(name, a_ms=20.0, c_ms=1.0, weights_mib=1024, item_mib=512, batch=8, ceiling=64, slo_mult=slo_mult)


@dataclass(frozen=True)
class FleetDef:
    name: str
    models: tuple[ModelDef, ...]
    phase: str  # random | together | staggered


FLEETS: dict[str, FleetDef] = {
    f.name: f
    for f in (
        FleetDef("one", (_mem("m0"),), "random"),
        FleetDef("together", tuple(_mem(f"m{i}") for i in range(3)), "together"),
        FleetDef("staggered", tuple(_mem(f"m{i}") for i in range(3)), "staggered"),
        FleetDef(
            "mixed",
            (
                ModelDef("compute", a_ms=2.0, c_ms=4.0, weights_mib=512, item_mib=32, batch=16, ceiling=64),
                _mem("memory"),
                ModelDef("tiny", a_ms=1.0, c_ms=0.2, weights_mib=128, item_mib=8, batch=16, ceiling=128),
            ),
            "random",
        ),
        FleetDef(
            "eight",
            tuple(
                ModelDef(f"e{i}", a_ms=8.0, c_ms=0.5, weights_mib=256, item_mib=128, batch=6, ceiling=64)
                for i in range(8)
            ),
            "random",
        ),
        FleetDef("slo", (_mem("tight", 0.5), _mem("mid", 1.0), _mem("loose", 2.0)), "random"),
    )
}


def fresh_seed() -> int:
    """A seed nobody chose: the clock's nanoseconds mixed with the OS's entropy."""
    return int(np.random.SeedSequence([time.time_ns(), int.from_bytes(os.urandom(8), "little")]).generate_state(1)[0])


def card_bytes(fleet: FleetDef) -> int:
    """The card: its usable share is the sum of the bases (nothing free to grow into but loans)."""
    return int(math.ceil(sum(m.base_bytes for m in fleet.models) / (1.0 - RESERVE_FRAC) / MIB) + 1) * MIB


def fleet_config(fleet: FleetDef, *, fixed: bool = False) -> ConfigDoc:
    """The fleet as a config dict (``parse_config``). Every arm runs the same rule: lazy batch
    formation, late requests shed at the gate, one request timeout. ``fixed``: quotas pinned at base."""
    models: dict[str, Any] = {}
    n = len(fleet.models)
    usable = sum(m.base_bytes for m in fleet.models)
    for m in fleet.models:
        floor = 2 if m.batch >= 2 else 1
        lo = (m.weights_mib + floor * m.item_mib) * MIB
        quota = (
            {"min": m.base_bytes, "base": m.base_bytes, "max": m.base_bytes}
            if fixed
            else {"min": lo, "base": m.base_bytes, "max": usable}
        )
        models[m.name] = {
            "model": "profiled",
            "options": {
                "a_ms": m.a_ms,
                "c_ms": m.c_ms,
                "weights_bytes": m.weights_mib * MIB,
                "bytes_per_item": m.item_mib * MIB,
            },
            "quota": quota,
            "batch": {"floor": floor, "ceiling": m.ceiling, "initial": m.batch},
            "wait": {"min_ms": 0, "max_ms": WAIT_MAX_MS},
            "slo_p95_ms": m.slo_ms(n),
            "max_queued": 2000,
            "request_timeout_s": 10.0,
            "shed_late": True,
            "control": {"strategy": "hybrid", "idle_hold_s": 5, "reclaim_hold_s": 1},
        }
    return {
        "broker": {"control_interval_s": 1.0, "report_interval_s": 0.5, "batch_formation": "lazy"},
        "gpu": {"device": "cpu", "capacity": card_bytes(fleet), "reserve_frac": RESERVE_FRAC},
        "models": models,
    }


def rates(fleet: FleetDef, level: float) -> dict[str, float]:
    """Each model's mean rate at this share of the fleet's capacity (module docstring)."""
    n = len(fleet.models)
    return {m.name: level * m.capacity_rps() / n for m in fleet.models}


# -- arrival processes with phases ----------------------------------------------------------


def _sub(seed: int, *keys: int) -> int:
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])


def _random_windows(duration_s: float, seed: int) -> list[tuple[float, float]]:
    """Bursts at random times of random lengths: exponential gaps and lengths, a random start."""
    rng = np.random.default_rng(seed)
    out, t = [], float(rng.uniform(0, OFF_MEAN_S))
    while t < duration_s:
        length = float(rng.exponential(ON_MEAN_S))
        out.append((t, min(duration_s, t + length)))
        t += length + float(rng.exponential(OFF_MEAN_S))
    return out


def _slots(duration_s: float, first: float, period: float) -> list[tuple[float, float]]:
    out, t = [], first
    while t < duration_s:
        out.append((t, min(duration_s, t + SLOT_S)))
        t += period
    return out


def burst_windows(phase: str, i: int, n: int, duration_s: float, seed: int) -> list[tuple[float, float]]:
    """Model i's burst windows under the fleet's phase (module docstring)."""
    if phase == "together":  # one schedule, the cell's: every model bursts in the same windows
        return _random_windows(duration_s, _sub(seed, 7))
    if phase == "staggered":  # in turn, a random offset for the cycle
        period = SLOT_S * max(n, 2)
        offset = float(np.random.default_rng(_sub(seed, 8)).uniform(0, SLOT_S))
        return _slots(duration_s, offset + i * SLOT_S, period)
    return _random_windows(duration_s, _sub(seed, 9, i))


def onoff(mean_rps: float, windows: list[tuple[float, float]], duration_s: float, seed: int) -> np.ndarray:
    """Poisson at ``OFF_SHARE x mean`` between bursts and at the rate that keeps the mean inside them."""
    on = sum(e - s for s, e in windows)
    if on <= 0:
        return arr.poisson(mean_rps, duration_s, seed)
    off_rate = OFF_SHARE * mean_rps
    on_rate = (mean_rps * duration_s - off_rate * (duration_s - on)) / on
    segs, t = [], 0.0
    for s, e in windows:
        segs += [(t, s, off_rate), (s, e, on_rate)]
        t = e
    segs.append((t, duration_s, off_rate))
    return arr.piecewise(segs, seed=seed)


def diurnal(mean_rps: float, phase_frac: float, duration_s: float, seed: int) -> np.ndarray:
    """A day compressed into the run: the rate follows a sine around the mean, in steps."""
    segs = []
    for k in range(int(math.ceil(duration_s / DIURNAL_STEP_S))):
        s, e = k * DIURNAL_STEP_S, min(duration_s, (k + 1) * DIURNAL_STEP_S)
        mid = (s + e) / 2 / duration_s
        segs.append((s, e, mean_rps * (1 + DIURNAL_AMPLITUDE * math.sin(2 * math.pi * (mid + phase_frac)))))
    return arr.piecewise(segs, seed=seed)


def diurnal_phase(phase: str, i: int, n: int, seed: int) -> float:
    if phase == "together":
        return float(np.random.default_rng(_sub(seed, 10)).uniform())
    if phase == "staggered":
        return i / n
    return float(np.random.default_rng(_sub(seed, 11, i)).uniform())


def times_for(process: str, fleet: FleetDef, level: float, duration_s: float, seed: int) -> dict[str, np.ndarray]:
    """Every model's arrival times in one cell (token lengths are not used: request models)."""
    if process not in PROCESSES:
        raise ValueError(f"arrival process '{process}' is not known; use one of {', '.join(PROCESSES)}")
    n = len(fleet.models)
    out: dict[str, np.ndarray] = {}
    for i, (name, rate) in enumerate(rates(fleet, level).items()):
        s = _sub(seed, 100 + i)
        if process == "poisson":
            out[name] = arr.poisson(rate, duration_s, s)
        elif process.startswith("gamma:"):
            out[name] = arr.gamma(rate, duration_s, float(process.split(":", 1)[1]), s)
        elif process == "onoff":
            out[name] = onoff(rate, burst_windows(fleet.phase, i, n, duration_s, seed), duration_s, s)
        elif process == "diurnal":
            out[name] = diurnal(rate, diurnal_phase(fleet.phase, i, n, seed), duration_s, s)
        else:
            out[name] = arr.trace(None, rate, duration_s, s)[0]
    return out
