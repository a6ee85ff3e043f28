"""A batch that fails inside the model: only what fails alone is lost.

``run_items(run_batch, items, ...)`` runs the batch. When ``run_batch`` raises, the batch is
split in two and each half retried, recursively, down to single items; only an item that fails
even alone gets an error, and only its own (the error raised by a batch holding it alone). Every
other item of the batch gets its output. Two kinds of failure take this one path:

- **out of memory** (``is_oom``): before the retry, cached memory is released and the process is
  asked whether it now holds over its grant (``held``). An item that runs out of memory alone
  gets an ``ItemOOM`` naming its cost, its estimated need and the grant, and the replica answers
  its request with HTTP ``OOM_STATUS`` (507 Insufficient Storage: the server cannot hold what
  this request needs under the model's grant; retrying the same input does not help until the
  grant grows).
- **any other exception** from ``predict``: an item that fails alone gets an ``ItemError``. An
  ``InputError`` (``gpubroker.InputError``) is answered 422 naming the item and its field, as a
  refusal from ``validate`` is; any other exception 500 naming the item, the model and the
  exception of its own lone run. The exception of a batch of several items is never shown to a
  client (it may quote any of their inputs): it is only logged.

``BatchResult.oom_costs`` lists the cost of every batch that ran out of memory although each of
its items then ran (so the batch, not an item, was too big): the broker lowers the model's
memory ceiling below the smallest of them at once (``gpubroker.broker.control.memory_model``), so the same cap
does not run out of memory twice in a row. A batch whose OOM an oversize item explains is not
counted there (a smaller cap would not have helped); the item's failure is.

``split_retry`` is the older all-or-nothing form: outputs, or the first item's OOM raised.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpubroker.deployments.models.base import InputError, OutputCountError, is_oom

OOM_STATUS = 507  # HTTP status of a request with an item that cannot run alone under the grant

MiB = 1024**2


def _release_cached_memory() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


_UNITS = {"b": 1, "kib": 1024, "mib": MiB, "gib": 1024**3, "tib": 1024**4, "bytes": 1}


def attempted_bytes(message: str) -> int | None:
    """The allocation an OOM message says failed: torch cpu "you tried to allocate 314572800
    bytes", torch cuda "Tried to allocate 2.00 GiB"; None when the message does not say."""
    match = re.search(r"tried to allocate ([0-9.]+)\s*(bytes|[KMGT]iB|B)\b", message, re.IGNORECASE)
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class ItemOOM:
    """An item that ran out of memory even alone (its request fails with ``OOM_STATUS``)."""

    index: int  # position of the item in the batch
    cost: float  # its cost in the model's unit (requests: 1, tokens: its tokens)
    need_bytes: int | None  # estimated bytes to run it alone (memory model), None when unknown
    attempted_bytes: int | None  # the allocation that failed, from the error message, None when unsaid
    grant_bytes: int | None  # this replica's grant when it failed, None when unlimited
    error: str  # the out-of-memory error, as raised

    def detail(self) -> str:
        need = (
            f"needs ~{self.need_bytes / MiB:.1f} MiB (estimated by the memory model)"
            if self.need_bytes is not None
            else "its need is unknown"
        )
        tried = f"; the failed allocation was {self.attempted_bytes / MiB:.1f} MiB" if self.attempted_bytes else ""
        grant = (
            f"the grant of {self.grant_bytes / MiB:.1f} MiB" if self.grant_bytes is not None else "the memory available"
        )
        return (
            f"out of memory running this item alone (cost {self.cost:g}): it {need}{tried}, over {grant}; "
            f"send a smaller input or raise the model's quota.max ({self.error})"
        )


@dataclass(frozen=True)
class HeldOverGrant:
    """Items not run because the replica holds more than its grant (a grant lowered under what it
    holds, or a model that grew into the slack and keeps it; ``gpubroker.deployments.enforce.limits``: the limit
    then stays at what is held + the runtime's slack). Their requests get 503 with Retry-After.
    The broker lends to a replica that refuses for this when a model idles, escalates a reclaim
    under it (caches, drain, restart), and the replica restarts itself when it stays held
    (``gpubroker.deployments.replica.deployment.HELD_RESTART_T``)."""

    model: str
    used_bytes: int  # the replica's resident memory over its baseline
    grant_bytes: int  # this replica's share of the grant

    def detail(self) -> str:
        return (
            f"model '{self.model}' holds {self.used_bytes / MiB:.1f} MiB, over its grant of "
            f"{self.grant_bytes / MiB:.1f} MiB: it runs no batch until it has the memory or restarts; retry later"
        )


ERROR_TEXT_CHARS = 500  # at most this much of a lone item's exception text reaches its client


@dataclass(frozen=True)
class ItemError:
    """An item whose ``predict`` raised (not out of memory) even in a batch of its own: its
    request alone fails, with this error. Only strings are kept (the exception and its frames,
    which may hold tensors, are let go before the next retry)."""

    index: int  # position of the item in the batch
    kind: str  # the exception's type name, e.g. "ValueError"
    message: str  # its text (InputError: its message), from the lone run; truncated to ERROR_TEXT_CHARS
    field: str | None  # InputError: the input field at fault ("body": the whole item); None for any other

    @classmethod
    def of(cls, index: int, exc: Exception) -> ItemError:
        field = exc.field if isinstance(exc, InputError) else None
        message = exc.message if isinstance(exc, InputError) else str(exc)
        return cls(index, type(exc).__name__, message[:ERROR_TEXT_CHARS], field)

    @property
    def status(self) -> int:
        return 422 if self.field is not None else 500


@dataclass(frozen=True)
class BatchResult:
    outputs: tuple[Any, ...]  # per item, in order: the model's output, an ItemOOM or an ItemError
    oom_costs: tuple[float, ...] = ()  # costs of batches that OOMed though each of their items then ran
    splits: int = 0  # batches split in two after an OOM
    error_splits: int = 0  # batches split in two after any other exception

    @property
    def failed(self) -> tuple[ItemOOM, ...]:
        return tuple(o for o in self.outputs if isinstance(o, ItemOOM))

    @property
    def errors(self) -> tuple[ItemError, ...]:
        return tuple(o for o in self.outputs if isinstance(o, ItemError))


@dataclass(frozen=True)
class ItemPricing:
    """How ``run_items`` prices items and explains one that runs out of memory alone (``ItemOOM``)."""

    cost: Callable[[Any], float] = lambda item: 1.0  # an item's cost in the model's unit
    need_bytes: Callable[[float], int | None] = lambda cost: None  # memory a batch of that cost needs
    grant_bytes: int | None = None  # this replica's grant (None: unlimited)


def run_items(
    run_batch: Callable[[list], Sequence[Any]],
    items: Sequence[Any],
    *,
    pricing: ItemPricing = ItemPricing(),
    on_split: Callable[[int], None] | None = None,
    release: Callable[[], None] = _release_cached_memory,
    held: Callable[[], Any] = lambda: None,
) -> BatchResult:
    """Outputs of ``run_batch`` for every item, in order; a batch that raises is split in two and
    each half retried, down to the items that fail alone (``ItemOOM``, ``ItemError``).

    ``pricing`` prices an item in the model's unit and estimates the memory a batch of that cost
    needs (the replica's memory model); ``release()`` gives cached memory back before a retry
    after an out-of-memory error (CUDA's cache, the heap); ``on_split(n)`` is called for each
    batch of ``n`` items split after one. ``held()``, asked after each out-of-memory error and its
    release, returns a marker (``HeldOverGrant``) when the process now holds over its grant: then
    the model runs no more, and every item not yet run gets the marker as its output (its memory
    would come out of the runtime's slack).

    Bound: the split is a bisection, and only a half that fails is split again. With a batch of
    ``n`` items of which ``k`` fail alone (deterministically), at most ``k·⌈log2 n⌉`` batches fail
    above the lone items and each costs two more calls: at most ``2·k·⌈log2 n⌉`` extra
    ``run_batch`` calls (O(k log n)), and never more than ``2n − 2``. A good batch costs one call.
    A wrong output count is the model's bug, not an input's: ``OutputCountError``, not split."""
    cost = pricing.cost
    costs: list[float] = []
    splits = {"oom": 0, "error": 0}
    stop: list[Any] = [None]  # held()'s marker once the process holds over its grant

    def run(start: int, chunk: list) -> tuple[list, bool]:
        """(outputs, every item ran)"""
        if not chunk:
            return [], True
        if stop[0] is not None:
            return [stop[0]] * len(chunk), False
        try:
            outputs = list(run_batch(chunk))
        except OutputCountError:  # the model's bug, not an input's: splitting would hide it
            raise
        except Exception as exc:  # noqa: BLE001 - any other failure of the model splits the batch
            failure: Exception | None = exc
        else:
            failure = None
        if failure is None:
            if len(outputs) != len(chunk):
                raise OutputCountError(f"model returned {len(outputs)} outputs for a batch of {len(chunk)} inputs")
            return outputs, True
        oom = is_oom(failure)
        alone = _lone_failure(start, chunk, failure, oom, pricing)
        del failure  # the failed batch's frames (and tensors) go before the retry
        if oom:
            release()
            stop[0] = held()
            if stop[0] is not None:
                return [stop[0]] * len(chunk), False
        if alone is not None:
            return [alone], False
        splits["oom" if oom else "error"] += 1
        if oom and on_split is not None:
            on_split(len(chunk))
        mid = len(chunk) // 2
        left, left_ok = run(start, chunk[:mid])
        right, right_ok = run(start + mid, chunk[mid:])
        if oom and left_ok and right_ok:  # the batch was too big, not one of its items
            costs.append(float(sum(cost(item) for item in chunk)))
        return left + right, left_ok and right_ok

    outputs, _ = run(0, list(items))
    return BatchResult(tuple(outputs), tuple(costs), splits["oom"], splits["error"])


def _lone_failure(start: int, chunk: list, exc: Exception, oom: bool, pricing: ItemPricing) -> Any:
    """The item's own failure when ``chunk`` is one item (``ItemOOM`` or ``ItemError``), else None."""
    if len(chunk) != 1:
        return None
    if not oom:
        return ItemError.of(start, exc)
    text = f"{type(exc).__name__}: {exc}"
    c = float(pricing.cost(chunk[0]))
    return ItemOOM(start, c, pricing.need_bytes(c), attempted_bytes(text), pricing.grant_bytes, text)


def oom_error(index: int, item: ItemOOM) -> dict[str, Any]:
    """The replica's answer to a request whose input ``index`` cannot run alone (``OOM_STATUS``)."""
    return {
        "status": OOM_STATUS,
        "detail": f"inputs[{index}]: {item.detail()}",
        "field": f"inputs[{index}]",
        "need_bytes": item.need_bytes,
        "attempted_bytes": item.attempted_bytes,
        "grant_bytes": item.grant_bytes,
    }


def item_error(index: int, item: ItemError, model: str) -> dict[str, Any]:
    """The replica's answer to a request whose input ``index`` failed in ``predict`` alone: 422
    naming the item and field for an ``InputError`` (as ``validate``'s refusals read), else 500
    naming the item, the model and the exception of the item's own run, never another's."""
    where = f"inputs[{index}]"
    if item.field is None:
        return {
            "status": 500,
            "detail": f"model '{model}' failed on {where}: {item.kind}: {item.message}",
            "field": where,
        }
    if item.field != "body":
        where = f"{where}.{item.field}"
    return {"status": 422, "detail": f"{where}: {item.message}", "field": where}


def need_from_calibration(calibration: dict[str, Any]) -> Callable[[float], int | None]:
    """``need_bytes`` for ``run_items`` from a replica's calibration: weights + bytes per unit x
    cost; None when it measured no per-unit memory."""
    per = float(calibration.get("bytes_per_unit", 0.0) or 0.0)
    weights = int(calibration.get("weights_bytes", 0) or 0)
    return lambda cost: int(weights + per * cost) if per > 0 else None


class OomCeiling:
    """The replica's own cap below the smallest batch that ran out of memory, held for
    ``hold_s`` (the broker's window, which holds its memory ceiling as long): between the OOM and
    the broker's next tick the fast loop must not widen back into the batch that failed."""

    def __init__(self, floor: int, hold_s: float, clock: Callable[[], float] = time.monotonic):
        self.floor = int(floor)
        self.hold_s = float(hold_s)
        self.clock = clock
        self.cap: int | None = None
        self.until_s = 0.0

    def learn(self, oom_costs: Sequence[float]) -> int:
        """A batch of each cost ran out of memory: the local ceiling is now below the smallest."""
        below = max(self.floor, int(min(oom_costs)) - 1)
        self.cap = below if self.cap is None or self.clock() >= self.until_s else min(self.cap, below)
        self.until_s = self.clock() + self.hold_s
        return self.cap

    def target(self, broker_cap: int) -> int:
        """The cap the fast loop may widen back to now."""
        if self.cap is not None and self.clock() >= self.until_s:
            self.cap = None
        return broker_cap if self.cap is None else min(broker_cap, self.cap)


class ItemOutOfMemory(MemoryError):
    """``split_retry``: an item ran out of memory even alone."""

    def __init__(self, item: ItemOOM):
        self.item = item
        super().__init__(item.detail())


def split_retry(
    run_batch: Callable[[list], Sequence[Any]],
    items: Sequence[Any],
    on_split: Callable[[int], None] | None = None,
) -> list:
    """All-or-nothing: the outputs of every item, or ``ItemOutOfMemory`` for the first item that
    cannot run alone (the other items have run by then; their outputs are dropped)."""
    result = run_items(run_batch, items, on_split=on_split)
    failed = result.failed
    if failed:
        raise ItemOutOfMemory(failed[0])
    return list(result.outputs)
