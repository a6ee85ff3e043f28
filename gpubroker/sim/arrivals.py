"""Open-loop arrival times, generated before a run (never "send the next when the last returns").

Every generator takes a seed and uses its own ``numpy.random.Generator``, so two arms of a
comparison given the same seed see exactly the same requests. Times are seconds from 0,
sorted, all ``< duration_s``; they come back as float64 numpy arrays.

- ``poisson``: exponential inter-arrival gaps (CV 1).
- ``gamma``: gamma gaps with shape 1/CV² and scale CV²/rate (mean 1/rate, CV as given);
  CV 2 and 4 are the burst cases of BENCHMARK.md.
- ``exact_count``: a Poisson or gamma draw with exactly ``rate x duration`` arrivals (a knee
  run's measured window: the offered rate is the nominal one).
- ``trace``: the Azure LLM inference trace 2023 (code service; CC-BY 4.0, Patel et al.,
  "Splitwise", ISCA 2024). Its inter-arrival gaps are scaled so their mean is 1/rate and
  replayed from a seed-chosen row, looping the trace when the duration needs more;
  ContextTokens gives each request's token length.
- ``split_rates``: a total rate over n models, even or power law (rate_i ∝ (i+1)^-0.5).
- ``burst``: one model jumps to 5× its rate for 60 s while the others go idle.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

TRACE_ENV = "GPUBROKER_TRACE"
# The trace is vendored in the repo (and shipped as package data): see gpubroker/sim/data/azure-llm-2023/README.md.
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv"


def _check(rate: float, duration_s: float) -> None:
    if not rate > 0:
        raise ValueError(f"rate ({rate}) must be > 0 requests per second")
    if not duration_s > 0:
        raise ValueError(f"duration_s ({duration_s}) must be > 0 seconds")


def _from_gaps(draw: Callable[[int], np.ndarray], rate: float, duration_s: float) -> np.ndarray:
    """Cumulative sums of gaps drawn in chunks until they pass duration_s."""
    chunks: list[np.ndarray] = []
    total = 0.0
    expected = int(rate * duration_s)
    chunk = max(64, int(expected * 1.1) + 16)
    while True:
        gaps = draw(chunk)
        times = total + np.cumsum(gaps)
        chunks.append(times)
        total = float(times[-1])
        if total >= duration_s:
            break
    times = np.concatenate(chunks)
    return times[times < duration_s]


def poisson(rate: float, duration_s: float, seed: int = 0) -> np.ndarray:
    """Poisson arrivals at ``rate`` per second over ``[0, duration_s)``."""
    _check(rate, duration_s)
    rng = np.random.default_rng(seed)
    return _from_gaps(lambda n: rng.exponential(1.0 / rate, n), rate, duration_s)


def gamma(rate: float, duration_s: float, cv: float, seed: int = 0) -> np.ndarray:
    """Gamma-renewal arrivals: gaps with mean 1/rate and coefficient of variation ``cv``."""
    _check(rate, duration_s)
    if not cv > 0:
        raise ValueError(f"cv ({cv}) must be > 0; 1 is Poisson-like, 2 and 4 are bursty")
    shape = 1.0 / cv**2
    scale = cv**2 / rate
    rng = np.random.default_rng(seed)
    return _from_gaps(lambda n: rng.gamma(shape, scale, n), rate, duration_s)


def exact_count(rate: float, duration_s: float, seed: int = 0, cv: float | None = None) -> np.ndarray:
    """Exactly ``round(rate * duration_s)`` arrivals over ``[0, duration_s)``, spaced like the
    renewal process of ``poisson`` (``cv`` None) or ``gamma``: n + 1 gaps are drawn and scaled
    so that they span the duration. For Poisson this is the process given its count (the n
    times are the order statistics of n uniforms); for gamma gaps it keeps their burstiness.
    A knee run's measured window is drawn this way, so the rate it is labelled with is the
    rate it offered: in a few seconds an unconditioned draw offers several percent more or
    less (sd 1/sqrt(rate * duration))."""
    _check(rate, duration_s)
    if cv is not None and not cv > 0:
        raise ValueError(f"cv ({cv}) must be > 0; 1 is Poisson-like, 2 and 4 are bursty")
    n = int(round(rate * duration_s))
    rng = np.random.default_rng([seed, 0x5EED])  # its own stream: not the plain draw's gaps
    gaps = rng.exponential(1.0, n + 1) if cv is None else rng.gamma(1.0 / cv**2, 1.0, n + 1)
    times = np.cumsum(gaps)
    times = times[:n] * (duration_s / times[n])
    out: np.ndarray = np.minimum(times, np.nextafter(duration_s, 0.0))
    return out


def trace_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The trace file: ``path``, else env GPUBROKER_TRACE, else the vendored copy (``DEFAULT_TRACE``)."""
    if path is not None:
        return Path(path)
    env = os.environ.get(TRACE_ENV)
    return Path(env) if env else DEFAULT_TRACE


_TRACE_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def load_trace(path: str | os.PathLike[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(inter-arrival gaps in seconds, ContextTokens per row) of the trace, sorted by time."""
    p = trace_path(path)
    key = str(p.resolve()) if p.exists() else str(p)
    if key in _TRACE_CACHE:
        return _TRACE_CACHE[key]
    if not p.exists():
        raise FileNotFoundError(
            f"arrival trace {p} not found; the repo ships it as {DEFAULT_TRACE} (restore it from git), "
            f"or set {TRACE_ENV}=/path/to/AzureLLMInferenceTrace_code.csv"
        )
    stamps: list[str] = []
    tokens: list[int] = []
    with p.open(encoding="utf-8") as fh:
        header = [h.strip() for h in fh.readline().split(",")]
        try:
            i_ts, i_ctx = header.index("TIMESTAMP"), header.index("ContextTokens")
        except ValueError:
            raise ValueError(f"{p}: header {header} lacks TIMESTAMP and ContextTokens columns") from None
        for line in fh:
            parts = line.rstrip("\n").split(",")
            if len(parts) <= max(i_ts, i_ctx) or not parts[i_ts]:
                continue
            stamps.append(parts[i_ts].strip())
            tokens.append(int(parts[i_ctx]))
    if len(stamps) < 2:
        raise ValueError(f"{p}: needs at least two rows to replay inter-arrival times")
    ts = np.array(stamps, dtype="datetime64[ns]").astype(np.int64)
    order = np.argsort(ts, kind="stable")
    ts, tok = ts[order], np.asarray(tokens, dtype=np.int64)[order]
    gaps = np.diff(ts).astype(np.float64) / 1e9
    # The gap before row 0, used when the replay wraps around: the trace's mean gap.
    gaps = np.concatenate([[gaps.mean()], gaps])
    tok = np.maximum(tok, 1)
    _TRACE_CACHE[key] = (gaps, tok)
    return gaps, tok


def trace(
    path: str | os.PathLike[str] | None = None, rate: float = 1.0, duration_s: float = 60.0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Replay the trace's gaps scaled to ``rate``; returns (times, token lengths = ContextTokens).

    The replay starts at a row chosen by ``seed`` and loops the trace as often as needed.
    """
    _check(rate, duration_s)
    gaps, tok = load_trace(path)
    scaled = gaps * (1.0 / (gaps.mean() * rate))
    n = len(gaps)
    start = int(np.random.default_rng(seed).integers(0, n))
    need = int(rate * duration_s * 1.5) + 16
    reps = need // n + 2
    idx = (start + np.arange(n * reps)) % n
    times = np.cumsum(scaled[idx])
    while times[-1] < duration_s:  # very bursty stretch: extend
        idx = np.concatenate([idx, (idx[-1] + 1 + np.arange(n)) % n])
        times = np.cumsum(scaled[idx])
    keep = times < duration_s
    return times[keep], tok[idx][keep]


def split_rates(total: float, n: int, how: str = "even") -> list[float]:
    """Split a total rate over n models: ``even`` or ``powerlaw`` (rate_i ∝ (i+1)^-0.5)."""
    if n < 1:
        raise ValueError(f"n ({n}) must be >= 1")
    if how == "even":
        return [total / n] * n
    if how == "powerlaw":
        w = np.arange(1, n + 1, dtype=np.float64) ** -0.5
        return [float(x) for x in total * w / w.sum()]
    raise ValueError(f"split '{how}' is not known; use 'even' or 'powerlaw'")


def piecewise(
    segments: list[tuple[float, float, float]], seed: int = 0, kind: str = "poisson", cv: float = 1.0
) -> np.ndarray:
    """Arrivals over consecutive segments ``(start_s, end_s, rate)``; rate 0 leaves a gap."""
    out: list[np.ndarray] = []
    for k, (start, end, rate) in enumerate(segments):
        if rate <= 0 or end <= start:
            continue
        sub = int(np.random.SeedSequence([seed, k]).generate_state(1)[0])
        if kind == "poisson":
            t = poisson(rate, end - start, sub)
        elif kind == "gamma":
            t = gamma(rate, end - start, cv, sub)
        else:
            raise ValueError(f"kind '{kind}' is not known; use poisson or gamma")
        out.append(start + t)
    return np.concatenate(out) if out else np.zeros(0)


def burst(
    rates: list[float],
    busy: int = 0,
    duration_s: float = 180.0,
    start_s: float = 60.0,
    length_s: float = 60.0,
    factor: float = 5.0,
    seed: int = 0,
) -> list[np.ndarray]:
    """The burst scenario: model ``busy`` runs at ``factor``× its rate during
    ``[start_s, start_s + length_s)`` while every other model goes idle, then all drop back.

    Returns one array of arrival times per model (Poisson within each segment).
    """
    if not 0 <= busy < len(rates):
        raise ValueError(f"busy ({busy}) must index one of the {len(rates)} rates")
    end = min(duration_s, start_s + length_s)
    out = []
    for i, rate in enumerate(rates):
        mid = rate * factor if i == busy else 0.0
        segs = [(0.0, start_s, rate), (start_s, end, mid), (end, duration_s, rate)]
        out.append(piecewise(segs, seed=seed * 1000 + i))
    return out
