"""Workloads for the simulator: per-model arrival times and request costs, made before a run.

``parse_arrivals`` reads the CLI form (``poisson``, ``gamma:CV``, ``trace``); ``make_workload``
draws every model's arrivals from one seed (model i uses a sub-seed of it, so every arm of a
comparison given the same seed sees the same requests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gpubroker.sim import arrivals as arr
from gpubroker.sim.profile import Profile


@dataclass(frozen=True)
class ArrivalSpec:
    kind: str  # poisson | gamma | trace
    cv: float = 1.0  # gamma only

    def label(self) -> str:
        return f"gamma:{self.cv:g}" if self.kind == "gamma" else self.kind


def parse_arrivals(text: str) -> ArrivalSpec:
    """``poisson``, ``gamma:CV`` (e.g. gamma:2) or ``trace``."""
    t = text.strip().lower()
    if t == "poisson":
        return ArrivalSpec("poisson")
    if t == "trace":
        return ArrivalSpec("trace")
    if t.startswith("gamma:"):
        try:
            cv = float(t.split(":", 1)[1])
        except ValueError:
            cv = -1.0
        if cv > 0:
            return ArrivalSpec("gamma", cv)
    raise ValueError(f"arrivals '{text}' is not known; use poisson, gamma:CV (e.g. gamma:2) or trace")


@dataclass(frozen=True)
class ModelArrivals:
    """One model's requests: arrival times (s) and cost per request (1, or tokens)."""

    times: np.ndarray  # float64, sorted
    costs: np.ndarray  # int64, same length; 1 for request models
    tokens: np.ndarray  # int64 token lengths (1 per request where the arrivals carry none)


def sub_seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1)[0])


def token_lengths(profile: Profile, n: int, seed: int) -> np.ndarray:
    """Lognormal lengths with the profile's mean and CV, clipped to [1, 8·mean]."""
    mean, cv = profile.mean_tokens, profile.tokens_cv
    if cv <= 0:
        return np.full(n, max(1, int(round(mean))), dtype=np.int64)
    sigma2 = np.log(1.0 + cv * cv)
    mu = np.log(mean) - sigma2 / 2
    rng = np.random.default_rng(seed)
    out = np.rint(rng.lognormal(mu, np.sqrt(sigma2), n))
    return np.clip(out, 1, 8 * mean).astype(np.int64)


def finish(times: np.ndarray, profile: Profile, tokens: np.ndarray | None, seed: int) -> ModelArrivals:
    """Attach costs to arrival times: token models count tokens, others count 1."""
    times = np.asarray(times, dtype=np.float64)
    n = len(times)
    if profile.unit == "tokens":
        tok = np.asarray(tokens, dtype=np.int64) if tokens is not None else token_lengths(profile, n, seed + 1)
        return ModelArrivals(times, tok.copy(), tok)
    tok = np.asarray(tokens, dtype=np.int64) if tokens is not None else np.ones(n, dtype=np.int64)
    return ModelArrivals(times, np.ones(n, dtype=np.int64), tok)


def make_workload(
    profiles: Mapping[str, Profile],
    rates: Mapping[str, float],
    duration_s: float,
    spec: ArrivalSpec | str = "poisson",
    seed: int = 0,
) -> dict[str, ModelArrivals]:
    """Arrivals for every model in ``profiles`` at ``rates`` (req/s; 0 = no traffic)."""
    if isinstance(spec, str):
        spec = parse_arrivals(spec)
    out: dict[str, ModelArrivals] = {}
    for i, (name, profile) in enumerate(profiles.items()):
        rate = float(rates.get(name, 0.0))
        s = sub_seed(seed, i)
        tokens = None
        if rate <= 0:
            times = np.zeros(0)
        elif spec.kind == "poisson":
            times = arr.poisson(rate, duration_s, s)
        elif spec.kind == "gamma":
            times = arr.gamma(rate, duration_s, spec.cv, s)
        else:
            times, tokens = arr.trace(None, rate, duration_s, s)
        out[name] = finish(times, profile, tokens, s)
    return out
