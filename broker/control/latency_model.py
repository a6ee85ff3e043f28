"""Online batch latency model L(b) = a + c*b, fitted by least squares over a bounded window.

The fit lets the policy jump to a good batch instead of creeping there by +1 steps. It is
clamped (a >= 0, c >= C_MIN_MS): a noisy window can give a negative slope, which would ask for
infinite batches. With a single batch size the slope is unidentified: the previous fit is kept,
or, with none, the latency is split evenly between fixed and per-item cost.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import mul
from typing import NamedTuple

C_MIN_MS = 1e-4  # smallest per-unit cost the fit may report (ms per request or token)
FIT_DECIMALS = 9  # a and c are kept to a nanosecond of a millisecond


class LatencyFit(NamedTuple):
    """A fitted L(b) (a named tuple: immutable, built per model per tick)."""

    a_ms: float  # fixed cost per batch
    c_ms: float  # cost per batch unit (request or token)
    samples: int  # samples behind the fit (0: prior only)

    def predict_ms(self, batch: float) -> float:
        return self.a_ms + self.c_ms * batch

    def largest_batch_within(self, budget_ms: float) -> float:
        """Largest b with L(b) <= budget_ms (0 when even b=0 does not fit)."""
        if budget_ms <= self.a_ms:
            return 0.0
        return (budget_ms - self.a_ms) / self.c_ms

    def saturated_rate(self, batch: float) -> float:
        """Units per second a replica serves back-to-back at this batch size."""
        return 1000.0 * batch / self.predict_ms(batch)


def fit_latency(timings: Iterable[tuple[float, float]], prior: LatencyFit | None = None) -> LatencyFit | None:
    """Least-squares a + c*b over (batch, exec_ms) pairs, clamped; None with no samples and no prior."""
    return fit_from_sums(fit_sums(timings), prior)


FitSums = tuple[int, float, float, float, float]  # n, sum b, sum ms, sum b^2, sum b*ms over valid points


def fit_sums(timings: Iterable[tuple[float, float]]) -> FitSums:
    """The sums a fit needs over the valid (batch > 0, exec_ms >= 0) pairs, each added in order."""
    pairs = tuple(timings)
    if not pairs:
        return 0, 0.0, 0.0, 0.0, 0.0
    bs, ms = zip(*pairs)
    sb, sl = sum(bs, 0.0), sum(ms, 0.0)
    # every pair valid (a NaN anywhere makes its sum NaN): the sums over all of them
    if sb == sb and sl == sl and min(bs) > 0 and min(ms) >= 0:
        return len(pairs), sb, sl, sum(map(mul, bs, bs), 0.0), sum(map(mul, bs, ms), 0.0)
    valid = [p for p in pairs if p[0] > 0 and p[1] >= 0]
    if not valid:
        return 0, 0.0, 0.0, 0.0, 0.0
    bs, ms = zip(*valid)
    return len(valid), sum(bs, 0.0), sum(ms, 0.0), sum(map(mul, bs, bs), 0.0), sum(map(mul, bs, ms), 0.0)


def fit_from_sums(sums: FitSums, prior: LatencyFit | None = None) -> LatencyFit | None:
    """``fit_latency`` from its sums (``fit_sums``)."""
    n, sb, sl, sbb, sbl = sums
    if n == 0:
        return prior
    mean_b = sb / n
    mean_l = sl / n
    var_b = max(0.0, sbb - sb * mean_b)
    if n < 3 or var_b < 1e-9 * max(1.0, mean_b**2) * n:
        if prior is not None and prior.samples > 0:
            return prior
        half = max(mean_l, 0.0) / 2.0
        return LatencyFit(a_ms=half, c_ms=max(C_MIN_MS, half / max(mean_b, 1.0)), samples=0)
    cov = sbl - sb * mean_l
    c = cov / var_b
    a = mean_l - c * mean_b
    if c < C_MIN_MS:  # flat or negative slope: all cost is fixed
        c = C_MIN_MS
        a = mean_l - c * mean_b
    if a < 0:  # line through the origin instead
        a = 0.0
        c = max(C_MIN_MS, sbl / sbb)
    # Sums lose the last bits that a two-pass fit keeps: round them off (far below any timing
    # noise) so exact samples give the exact line, and a plan floored from it its exact batch.
    return LatencyFit(a_ms=round(a, FIT_DECIMALS), c_ms=max(C_MIN_MS, round(c, FIT_DECIMALS)), samples=n)
