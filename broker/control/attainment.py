"""SLO attainment: the one definition that status, metrics and the policy share.

A request counts as met when it was answered within the model's effective P95 cap
(``slo_p95_ms`` x the active profile's latency slack); every other request it was asked to
serve (rejected, timed out, failed) counts as a miss. Replicas send a sample of latencies with
an exact completion count, so the met share of the samples is scaled to the completions.
"""

from __future__ import annotations

from collections.abc import Sequence


def met_and_total(
    latency_ms: Sequence[float], completions: int, rejections: int, timeouts: int, errors: int, slo_ms: float
) -> tuple[float, int]:
    """(requests answered within ``slo_ms``, requests that count) for one report."""
    met = 0.0
    if latency_ms and completions:
        met = completions * sum(1 for x in latency_ms if x <= slo_ms) / len(latency_ms)
    return met, completions + rejections + timeouts + errors


def attainment(met: float, total: int) -> float | None:
    return (met / total) if total else None
