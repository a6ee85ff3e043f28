"""Fold replicas' stats deltas into per-model load over a sliding window.

Not a policy, but pure all the same: the time of each report and of each snapshot comes in
as an argument, so the simulator and the live broker share this code. Percentiles are taken
over ``control.window_s`` (never a single sample); rates and utilisation over a shorter
window (``rate_window_s``) so the controller sees a burst within seconds.

Each snapshot also lists, per model, every live replica (one that reported within
``stale_after_s``) with the broker time of its latest report, the settings version it ran and
the memory it measured (``ModelLoad.replica_reports``): a two-phase quota transfer completes
only on reports from all of them that arrived after it began (``broker.lending``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

from broker.attainment import attainment, met_and_total
from broker.types import FleetSnapshot, GpuLoad, ModelLoad, ReplicaSeen, StatsReport
from quotas.config import FleetConfig

MAX_LATENCY_SAMPLES = 20_000  # per model per window, newest kept


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values) - 1e-9) - 1))
    return sorted_values[k]


class ReportWindow:
    def __init__(self, config: FleetConfig):
        self._events: dict[str, deque[tuple[float, StatsReport]]] = {}
        self._edge: dict[
            str, deque[tuple[float, int]]
        ] = {}  # rejections at the ingress (Serve queue full, replica gone)
        self._last_snapshot_s = float("-inf")
        self._slo_ms: dict[str, float] = {}  # effective P95 caps of the last snapshot call
        self.reconfigure(config)

    def reconfigure(self, config: FleetConfig) -> None:
        self._config = config
        for name in config.models:
            self._events.setdefault(name, deque())
            self._edge.setdefault(name, deque())
        for name in list(self._events):
            if name not in config.models:
                del self._events[name]
                self._edge.pop(name, None)

    def add(self, report: StatsReport, received_s: float) -> bool:
        """Keep a report; False (ignored) for a model the config does not know."""
        events = self._events.get(report.model)
        if events is None:
            return False
        events.append((received_s, report))
        return True

    def add_rejections(self, model: str, count: int, received_s: float) -> bool:
        """Requests refused before reaching a replica (the ingress saw Serve's queue full or a
        dead replica): they count as misses and rejections like a replica's own."""
        edge = self._edge.get(model)
        if edge is None or count <= 0:
            return False
        edge.append((received_s, int(count)))
        return True

    def rate_window_s(self) -> float:
        broker = self._config.broker
        return max(5.0, 4.0 * broker.control_interval_s, 4.0 * broker.report_interval_s)

    def stale_after_s(self) -> float:
        return max(2.0, 5.0 * self._config.broker.report_interval_s)

    def snapshot(
        self,
        now_s: float,
        gpu: GpuLoad,
        memory_models: Mapping[str, tuple[int, float]] | None = None,
        slo_ms: Mapping[str, float] | None = None,
    ) -> FleetSnapshot:
        """``slo_ms``: each model's effective P95 cap now (slack of the active profile applied);
        attainment (``broker.attainment``) is measured against it, else against ``slo_p95_ms``."""
        memory_models = memory_models or {}
        self._slo_ms = dict(slo_ms or {})
        since = self._last_snapshot_s
        self._last_snapshot_s = now_s
        models = {
            name: self._model_load(name, now_s, since, memory_models.get(name, (0, 0.0)))
            for name in self._config.models
        }
        return FleetSnapshot(now_s=now_s, gpu=gpu, models=models)

    def _model_load(self, name: str, now_s: float, since_s: float, memory: tuple[int, float]) -> ModelLoad:
        spec = self._config.models[name]
        window_s = spec.control.window_s
        events = self._events[name]
        while events and events[0][0] < now_s - window_s:
            events.popleft()
        rate_from = now_s - self.rate_window_s()
        recent_from = now_s - max(1.0, 2.0 * self._config.broker.report_interval_s) - 1e-9
        recent_acc: dict[str, list[float]] = {}
        live_from = now_s - self.stale_after_s()

        latest: dict[str, StatsReport] = {}
        received: dict[str, float] = {}  # replica -> broker time its latest report arrived
        peak: dict[str, int] = {}
        per_replica: dict[str, list[float]] = {}  # arrivals, completions, rejects, busy_s, interval_s
        latencies: list[float] = []
        recent: list[float] = []
        timings: list[tuple[float, float]] = []
        batch_cost = batch_requests = 0.0
        batches = 0
        emergency = False
        oom_splits = 0
        oom_costs: list[float] = []  # every OOMed batch in the window: the memory ceiling stays below them
        slo = self._slo_ms.get(name, spec.slo_p95_ms)
        met = 0.0
        counted = 0
        max_cost = 0.0  # biggest batch over the window (what the window's peak memory ran)
        for t, r in events:
            if t >= live_from:
                latest[r.replica_id] = r
                received[r.replica_id] = t
            peak[r.replica_id] = max(peak.get(r.replica_id, 0), r.mem_peak_bytes, r.mem_used_bytes)
            latencies.extend(r.latency_ms)
            m, c = met_and_total(r.latency_ms, r.completions, r.rejections, r.timeouts, r.errors, slo)
            met += m
            counted += c
            timings.extend(r.batches)
            oom_costs.extend(r.oom_costs)
            for (cost, _), reqs in zip(r.batches, r.batch_requests):
                batch_cost += cost
                batch_requests += reqs
                if cost > max_cost:
                    max_cost = cost
            batches += len(r.batches)
            if t > since_s:
                emergency = emergency or r.emergency_shrinks > 0
                oom_splits += r.oom_splits
            if t >= recent_from:
                racc = recent_acc.setdefault(r.replica_id, [0.0, 0.0])
                racc[0] += r.arrivals
                racc[1] += r.interval_s
            if t >= rate_from:
                recent.extend(r.latency_ms)
                acc = per_replica.setdefault(r.replica_id, [0.0, 0.0, 0.0, 0.0, 0.0])
                acc[0] += r.arrivals
                acc[1] += r.completions
                acc[2] += r.rejections + r.timeouts
                acc[3] += r.busy_s
                acc[4] += r.interval_s

        edge = self._edge[name]
        while edge and edge[0][0] < now_s - window_s:
            edge.popleft()
        edge_total = sum(n for _, n in edge)
        edge_recent = sum(n for t, n in edge if t >= rate_from)
        counted += edge_total

        def rate(i: int) -> float:
            return sum(acc[i] / acc[4] for acc in per_replica.values() if acc[4] > 0)

        busy = [acc[3] / acc[4] for acc in per_replica.values() if acc[4] > 0]
        if len(latencies) > MAX_LATENCY_SAMPLES:
            latencies = latencies[-MAX_LATENCY_SAMPLES:]
        latencies.sort()
        recent.sort()
        fit_window = spec.control.fit_window
        return ModelLoad(
            name=name,
            replicas=len(latest),
            queue_depth=float(sum(r.queue_depth for r in latest.values())),
            arrival_rate_rps=rate(0),
            recent_arrival_rate_rps=sum(a / i for a, i in recent_acc.values() if i > 0),
            completion_rate_rps=rate(1),
            reject_rate_rps=rate(2) + edge_recent / self.rate_window_s(),
            p50_ms=percentile(latencies, 50),
            p95_ms=percentile(latencies, 95),
            p99_ms=percentile(latencies, 99),
            latency_samples=len(latencies),
            recent_p95_ms=percentile(recent, 95),
            recent_samples=len(recent),
            attainment=attainment(met, counted),
            batch_timings=tuple(timings[-fit_window:]),
            mean_batch=(batch_cost / batches) if batches else 0.0,
            max_batch=max_cost,
            cost_per_request=(batch_cost / batch_requests) if batch_requests else 1.0,
            busy_frac=(sum(busy) / len(busy)) if busy else 0.0,
            mem_used_bytes=sum(r.mem_used_bytes for r in latest.values()),
            mem_peak_bytes=sum(peak.get(rid, 0) for rid in latest),
            emergency=emergency,
            oom_splits=oom_splits,
            oom_costs=tuple(oom_costs),
            settings_version=min((r.settings_version for r in latest.values()), default=0),
            weights_bytes=int(memory[0]),
            bytes_per_unit=float(memory[1]),
            cost_unit=spec.batch.unit,
            replica_reports=tuple(
                ReplicaSeen(rid, received[rid], r.settings_version, r.mem_used_bytes)
                for rid, r in sorted(latest.items())
            ),
        )
