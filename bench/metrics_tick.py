"""The live broker's metrics step side by side: ``BrokerMetrics.observe_tick`` of another tree's
``broker/metrics.py`` against this one's, on the calls the live 16 x 100 fleet makes over 60 s.

    git show REV:broker/metrics.py > /tmp/old_metrics.py
    python -m bench.metrics_tick /tmp/old_metrics.py

Five interleaved rounds of the same recorded calls, each on a fresh registry; prints ms per
fleet tick (16 cards' calls) and the ratio of the medians.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry

import broker.metrics as this_tree
from bench.scale import _Cores, synthetic_doc

TICKS = 60


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpubroker_other_metrics", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}: give the path of a broker/metrics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def recorded_calls() -> list[tuple[str, Any, Any]]:
    """(card, decision, status) of every ``observe_tick`` the live 16 x 100 fleet makes in 60 s."""
    calls: list[tuple[str, Any, Any]] = []
    orig = this_tree.BrokerMetrics.observe_tick

    def record(self: Any, decision: Any, status: Any, tick_s: float) -> None:
        calls.append((self.gpu, decision, status))
        orig(self, decision, status, tick_s)

    this_tree.BrokerMetrics.observe_tick = record  # type: ignore[method-assign]
    try:
        cores = _Cores(synthetic_doc(100, cards=16), 0, live_dir=Path(tempfile.mkdtemp(prefix="gpubroker-metrics-")))
        cores.run(30.0)
        calls.clear()
        cores.run(float(TICKS))
    finally:
        this_tree.BrokerMetrics.observe_tick = orig  # type: ignore[method-assign]
    return calls


def ms_per_tick(mod: ModuleType, calls: list[tuple[str, Any, Any]]) -> float:
    root = mod.BrokerMetrics(CollectorRegistry(), gpu="x")
    views: dict[str, Any] = {}
    started = time.perf_counter()
    for gpu, decision, status in calls:
        view = views.get(gpu) or views.setdefault(gpu, root.for_gpu(gpu))
        view.observe_tick(decision, status, 0.001)
    return (time.perf_counter() - started) / TICKS * 1000.0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    other = _load(argv[0])
    calls = recorded_calls()
    runs: dict[str, list[float]] = {"other": [], "this": []}
    for _ in range(5):
        runs["other"].append(ms_per_tick(other, calls))
        runs["this"].append(ms_per_tick(this_tree, calls))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"{len(calls)} observe_tick calls; ms per 16 x 100 tick, five rounds each:")
    for k, v in runs.items():
        print(f"  {k:5s} {' '.join(f'{x:.2f}' for x in v)}  (median {med[k]:.2f})")
    print(f"this / other: {med['this'] / med['other']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
