"""The cyclic garbage collector held off while a control tick runs.

Design note. A tick allocates many short-lived containers (records, sorted latency samples,
settings dicts), so CPython's cyclic collector, which runs whenever allocations pass its
thresholds, ran inside the tick: on the 16-card x 100-model fleet of ``bench.scale`` a young
collection every third tick or so (4 ms on average, up to 11, on the 2-core machines) and an
older one in about one tick in forty (up to 32 ms), most of the tick's P99 (measured with
``gc.callbacks``; docs/BENCHMARKS.md, "The control plane's cost"). The broker's records are
trees, not cycles, so holding the collector off for a tick's tens of milliseconds leaves
nothing behind: the collections its allocations called for run at the first allocation after
it, between ticks, where they delay a replica report's reply by the same milliseconds instead
of every model's next settings. The work is moved, not saved; ``bench.scale`` reports it per
tick beside the tick (``gc_ms_per_tick``).

``gc_held`` wraps a function: the collector is disabled for the call and enabled again after
it, also when the call raises. A call made while it is already off (a ``FleetBroker`` tick
ticking its cards' cores, or a caller that turned it off itself) leaves it as it found it.

``tune_collector`` sets the broker process's collector thresholds (``BROKER_GC_THRESHOLDS``;
the broker actor calls it when it starts). With CPython's default (700, 10, 10) a young
collection runs every 700 net allocations of tracked objects, and at most one in a hundred
scans the whole heap (fewer while the heap grows by less than a quarter), which in the broker
is every model's report window. With the young threshold at 10,000 the collector ran 7 times
instead of 640 over 90 ticks of ``bench.scale``'s 1-card, 1000-model fleet, and took 8.4 ms a
tick instead of 29.0. On the 16 x 100 fleet it took 0.07 ms a tick instead of 1.1-1.7. The
garbage that only it can free is cycles, and the broker's records are trees, so little waits
longer to be freed. The longest single collection stays about the same (231 ms against 257 on
the 1000-model fleet): it is the full scan, now run less often.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

BROKER_GC_THRESHOLDS = (10_000, 10, 10)  # young, middle, old (module note); CPython's default: (700, 10, 10)


def tune_collector(thresholds: tuple[int, int, int] = BROKER_GC_THRESHOLDS) -> tuple[int, int, int]:
    """Set this process's collector thresholds (module note); returns the previous ones."""
    was = gc.get_threshold()
    gc.set_threshold(*thresholds)
    return was


def gc_held(fn: _F) -> _F:
    """``fn`` with the cyclic collector off while it runs (module note)."""

    @functools.wraps(fn)
    def held(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return held  # type: ignore[return-value]
