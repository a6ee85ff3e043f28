"""What a model needs of its quota when it lends or borrows (``broker.control.lending``): the smallest
batch a lender keeps memory for (``peak_batch``), and whether a model that wants more memory is
held back by it now (``pressed``). Pure: they read one model's window and spec."""

from __future__ import annotations

import math

from broker.control.latency_model import LatencyFit
from broker.control.types import ModelLoad
from quotas.config import ModelSpec

# a lender keeps its peak memory x control.working_set_margin (a config tuning constant)
# a lender lowered to batch b must keep its window's P99, scaled to b, within this share of its SLO:
# the window is a sample, and the tail the lender has not seen yet needs room too
LEND_TAIL_FRAC = 0.7


def peak_batch(load: ModelLoad, spec: ModelSpec, fit: LatencyFit | None) -> int:
    """The smallest batch a lender may be lowered to: what its own demand at the window's peak
    needs within its SLO (a lender keeps the memory for it, up to its base).

    The window's peak ran batches of up to ``max_batch`` (``peak``). A model that missed its SLO
    in the window (attainment under 1) needed all of them. Otherwise a smaller batch ``b`` is
    enough when the window's P99 stays within the SLO at the rate ``b`` drains a queue: a queue
    of requests takes ``L(b) / b`` per request instead of ``L(peak) / peak`` (the latency fit;
    with none, ``1 / b``: no fixed cost to share, the largest slowdown), so the P99 scales by
    their ratio. No latency samples in the window: the floor."""
    floor = max(1, spec.batch.floor)
    peak = max(floor, math.ceil(load.max_batch))
    if load.attainment is not None and load.attainment < 1.0:
        return peak
    if load.p99_ms is None or load.latency_samples == 0:
        return floor

    def per_request_ms(b: int) -> float:
        return (fit.predict_ms(b) if fit is not None else 1.0) / b

    for b in range(floor, peak):
        if load.p99_ms * per_request_ms(b) / per_request_ms(peak) <= LEND_TAIL_FRAC * spec.slo_p95_ms:
            return b
    return peak


NOT_PRESSED = "not pressed"  # ``pressed(..., explain=False)``'s answer for every reason


def pressed(load: ModelLoad, spec: ModelSpec, ceiling: int | None, explain: bool = True) -> str | None:
    """Why a model that wants more memory should not borrow it (None: it should).

    A batch cap that wants more than the grant holds is not a need by itself (with lazy
    formation every model wants a large cap). A borrower must be held back by its memory now:
    its window's biggest batch reached the ceiling its grant holds, and it is behind: a backlog
    its ceiling cannot take in one batch per replica, or its recent P95 over its SLO. Or it
    refuses requests because it holds over its grant (``held_over``: it runs no batch).
    ``explain=False``: the same answer, with ``NOT_PRESSED`` for every reason (nothing formatted)."""
    if ceiling is None:  # memory does not limit its batch
        return "memory does not limit its batch" if explain else NOT_PRESSED
    if load.held_over:
        return None
    if load.max_batch < ceiling:
        if not explain:
            return NOT_PRESSED
        return f"its biggest batch in the window ({load.max_batch:.0f}) is under its memory ceiling {ceiling}"
    backlog = load.queue_depth > ceiling * max(1, load.replicas)
    late = load.recent_p95_ms is not None and load.recent_p95_ms > spec.slo_p95_ms
    if not (backlog or late):
        if not explain:
            return NOT_PRESSED
        return (
            f"not behind (queue {load.queue_depth:.0f}, recent P95 "
            f"{0.0 if load.recent_p95_ms is None else load.recent_p95_ms:.0f} ms within its SLO {spec.slo_p95_ms:g} ms)"
        )
    return None


__all__ = ["LEND_TAIL_FRAC", "NOT_PRESSED", "peak_batch", "pressed"]
