"""OOM split-retry: no request is lost to an out-of-memory error inside a batch.

``split_retry(run_batch, items)`` runs the batch; on an OOM (``is_oom``) it splits the batch
in two and retries each half, recursively, down to single items. A single item that still
runs out of memory re-raises: that request is too large for the grant.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

from deployments.models.base import is_oom


def _release_cached_memory() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def split_retry(
    run_batch: Callable[[list], Sequence[Any]],
    items: Sequence[Any],
    on_split: Callable[[int], None] | None = None,
) -> list:
    """Outputs of ``run_batch`` for every item, in order, splitting batches that OOM.

    ``on_split(n)`` is called once for each batch of ``n`` items that was split (the replica
    counts these as ``oom_splits``).
    """
    items = list(items)
    if not items:
        return []
    oom = False
    try:
        outputs = list(run_batch(items))
    except Exception as exc:
        if len(items) <= 1 or not is_oom(exc):
            raise
        oom = True
    if not oom:
        if len(outputs) != len(items):
            raise RuntimeError(f"model returned {len(outputs)} outputs for a batch of {len(items)} inputs")
        return outputs
    # Outside the except block: the failed batch's frames (and tensors) are released first.
    _release_cached_memory()
    if on_split is not None:
        on_split(len(items))
    mid = len(items) // 2
    return split_retry(run_batch, items[:mid], on_split) + split_retry(run_batch, items[mid:], on_split)
