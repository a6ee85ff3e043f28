"""Fold replicas' stats deltas into per-model load over a sliding window.

Not a policy, but pure all the same: the time of each report and of each snapshot comes in
as an argument, so the simulator and the live broker share this code. Percentiles are taken
over ``control.window_s`` (never a single sample); rates and utilisation over a shorter
window (``rate_window_s``) so the controller sees a burst within seconds.

Each snapshot also lists, per model, every live replica (one that reported within
``stale_after_s``) with the broker time of its latest report, the settings version it ran and
the memory it measured (``ModelLoad.replica_reports``): a two-phase quota transfer completes
only on reports from all of them that arrived after it began (``broker.control.lending``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from itertools import chain

from broker.control.attainment import attainment
from broker.control.window_fold import _OOM, _Digest, _ModelWindow, percentile, tail_percentiles
from broker.control.types import FleetSnapshot, GpuLoad, ModelLoad, ReplicaSeen
from broker.wire import StatsReport
from quotas.config import FleetConfig

MIN_INTERVAL_S = 1e-9  # a replica's reports covering less than this say nothing about its rates


def stale_after_s(config: FleetConfig) -> float:
    """A replica that has not reported for this long is not live (five report intervals, at least 2 s)."""
    return max(2.0, 5.0 * config.broker.report_interval_s)


class ReportWindow:
    def __init__(self, config: FleetConfig):
        self._events: dict[str, _ModelWindow] = {}
        self._edge: dict[
            str, deque[tuple[float, int]]
        ] = {}  # rejections at the ingress (Serve queue full, replica gone)
        self._last_snapshot_s = float("-inf")
        self._slo_ms: dict[str, float] = {}  # effective P95 caps of the last snapshot call
        self.reconfigure(config)

    def reconfigure(self, config: FleetConfig) -> None:
        self._config = config
        for name, spec in config.models.items():
            window = self._events.setdefault(
                name, _ModelWindow(self._slo_ms.get(name, spec.slo_p95_ms), spec.control.fit_window)
            )
            window.set_fit_window(spec.control.fit_window)
            self._edge.setdefault(name, deque())
        for name in list(self._events):
            if name not in config.models:
                del self._events[name]
                self._edge.pop(name, None)

    def add(self, report: StatsReport, received_s: float) -> bool:
        """Keep a report; False (ignored) for a model the config does not know."""
        window = self._events.get(report.model)
        if window is None:
            return False
        window.add(_Digest(received_s, report, window.slo_ms))
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
        return stale_after_s(self._config)

    def snapshot(
        self,
        now_s: float,
        gpu: GpuLoad,
        memory_models: Mapping[str, tuple[int, float]] | None = None,
        slo_ms: Mapping[str, float] | None = None,
    ) -> FleetSnapshot:
        """``slo_ms``: each model's effective P95 cap now (slack of the active profile applied);
        attainment (``broker.control.attainment``) is measured against it, else against ``slo_p95_ms``."""
        memory_models = memory_models or {}
        self._slo_ms = dict(slo_ms or {})
        self._rate_s, self._stale_s = self.rate_window_s(), self.stale_after_s()
        self._recent_s = max(1.0, 2.0 * self._config.broker.report_interval_s) + 1e-9
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
        mw = self._events[name]
        mw.evict(now_s - window_s)
        events = mw.events
        mw.recount(self._slo_ms.get(name, spec.slo_p95_ms))
        rate_from, recent_from, live_from = now_s - self._rate_s, now_s - self._recent_s, now_s - self._stale_s
        mw.advance_rate(max(rate_from, now_s - window_s))

        # each live replica's newest report (one that came within stale_after_s), in id order
        queue = used = peak = 0
        version: int | None = None
        seen: list[ReplicaSeen] = []
        latest, peaks = mw.latest, mw.peaks
        for rid in sorted(latest) if len(latest) > 1 else latest:
            d = latest[rid]
            if d.t < live_from:
                continue
            r = d.report
            queue += r.queue_depth
            used += r.mem_used_bytes
            peak += peaks[rid][0].peak
            v = r.settings_version
            if version is None or v < version:
                version = v
            seen.append(ReplicaSeen(rid, d.t, v, r.mem_used_bytes))
        edge = self._edge[name]
        if edge:
            while edge and edge[0][0] < now_s - window_s:
                edge.popleft()
        if not mw.acts and not edge:
            return self._quiet_load(name, spec.batch.unit, mw, queue, used, peak, version, seen, memory)
        # the window's sums: kept as reports come and go, or summed in C over the digests
        latencies = mw.latencies()
        oom_costs = tuple(chain.from_iterable(map(_OOM, events))) if mw.oom else ()  # the ceiling stays below them
        met, batch_cost = mw.sums_met_cost()
        counted = mw.counted_sum
        batch_requests = mw.requests_sum
        batches = mw.nbatch_sum
        max_cost = mw.max_costs[0].max_cost if mw.max_costs else 0.0  # the batch behind the window's peak
        emergency = held = False
        oom_splits = 0
        recent_acc: dict[str, list[float]] = {}
        for d in reversed(events):  # the last report or two of each replica, and those since the last snapshot
            t = d.t
            if t < recent_from and t <= since_s:
                break
            if t > since_s:
                emergency = emergency or d.emergency
                held = held or d.held
                oom_splits += d.oom_splits
            if t >= recent_from:
                racc = recent_acc.get(d.rid)
                if racc is None:
                    racc = recent_acc[d.rid] = [0.0, 0.0]
                racc[0] += d.arrivals
                racc[1] += d.interval
        recent_rate = 0.0
        for a, i in recent_acc.values():
            if i > 0:
                recent_rate += a / i
        recent = mw.rate_latencies()

        edge_recent = 0
        if edge:
            counted += sum(n for _, n in edge)
            edge_recent = sum(n for t, n in edge if t >= rate_from)

        # the rate window's per-replica rates, summed over replicas (busy: averaged)
        arrival = completion = reject = busy = 0.0
        rated = 0
        for acc in mw.rate_acc.values():
            iv = acc[4]
            if iv > MIN_INTERVAL_S:
                arrival += acc[0] / iv
                completion += acc[1] / iv
                reject += acc[2] / iv
                busy += acc[3] / iv
                rated += 1
        p50, p95, p99 = tail_percentiles(latencies)
        return ModelLoad(
            name=name,
            replicas=len(seen),
            queue_depth=float(queue),
            arrival_rate_rps=arrival,
            recent_arrival_rate_rps=recent_rate,
            completion_rate_rps=completion,
            reject_rate_rps=reject + edge_recent / self._rate_s,
            p50_ms=p50,
            p95_ms=p95,
            p99_ms=p99,
            latency_samples=len(latencies),
            recent_p95_ms=percentile(recent, 95),
            recent_samples=len(recent),
            attainment=attainment(met, counted),
            batch_timings=mw.batch_timings(),
            fit_sums=mw.fit_sums_now(),
            fit_max_cost=mw.biggest_fit_cost(),
            mean_batch=(batch_cost / batches) if batches else 0.0,
            max_batch=max_cost,
            cost_per_request=(batch_cost / batch_requests) if batch_requests else 1.0,
            busy_frac=(busy / rated) if rated else 0.0,
            mem_used_bytes=used,
            mem_peak_bytes=peak,
            emergency=emergency,
            held_over=held,
            oom_splits=oom_splits,
            oom_costs=oom_costs,
            settings_version=version or 0,
            weights_bytes=int(memory[0]),
            bytes_per_unit=float(memory[1]),
            cost_unit=spec.batch.unit,
            replica_reports=tuple(seen),
        )

    @staticmethod
    def _quiet_load(
        name: str,
        unit: str,
        mw: _ModelWindow,
        queue: int,
        used: int,
        peak: int,
        version: int | None,
        seen: list[ReplicaSeen],
        memory: tuple[int, float],
    ) -> ModelLoad:
        """The load of a window whose reports carry no activity (``_Digest.active``) and no
        refusals at the ingress: every rate is 0, no latency, no batch. The same record the full
        fold gives (a test compares them), without its passes over the window."""
        met, batch_cost = mw.sums_met_cost()
        busy = 0.0  # the busy seconds' float sums can keep a remainder: summed as the full fold does
        rated = 0
        for acc in mw.rate_acc.values():
            if acc[4] > MIN_INTERVAL_S:
                busy += acc[3] / acc[4]
                rated += 1
        return ModelLoad(
            name=name,
            replicas=len(seen),
            queue_depth=float(queue),
            arrival_rate_rps=0.0,
            recent_arrival_rate_rps=0.0,
            completion_rate_rps=0.0,
            reject_rate_rps=0.0,
            p50_ms=None,
            p95_ms=None,
            p99_ms=None,
            latency_samples=0,
            recent_p95_ms=None,
            recent_samples=0,
            attainment=attainment(met, mw.counted_sum),
            batch_timings=mw.batch_timings(),
            fit_sums=mw.fit_sums_now(),
            fit_max_cost=mw.biggest_fit_cost(),
            mean_batch=0.0,
            max_batch=mw.max_costs[0].max_cost if mw.max_costs else 0.0,
            cost_per_request=1.0,
            busy_frac=(busy / rated) if rated else 0.0,
            mem_used_bytes=used,
            mem_peak_bytes=peak,
            emergency=False,
            held_over=False,
            oom_splits=0,
            oom_costs=(),
            settings_version=version or 0,
            weights_bytes=int(memory[0]),
            bytes_per_unit=float(memory[1]),
            cost_unit=unit,
            replica_reports=tuple(seen),
        )
