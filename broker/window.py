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
from bisect import bisect_left
from collections import deque
from collections.abc import Mapping
from itertools import chain
from operator import attrgetter

from broker.attainment import attainment, met_and_total
from broker.latency_model import fit_sums
from broker.records import build
from broker.types import FleetSnapshot, GpuLoad, ModelLoad, ReplicaSeen, StatsReport
from quotas.config import FleetConfig

MAX_LATENCY_SAMPLES = 20_000  # per model per window, newest kept
MIN_INTERVAL_S = 1e-9  # a replica's reports covering less than this say nothing about its rates


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values) - 1e-9) - 1))
    return sorted_values[k]


class _Digest:
    """One report folded once, when it arrives: what every snapshot of its window adds up."""

    __slots__ = (
        "arrivals",
        "batches",
        "busy_s",
        "completions",
        "cost",
        "counted",
        "emergency",
        "interval",
        "lat",
        "max_cost",
        "met",
        "misses",
        "n_batches",
        "oom_costs",
        "oom_splits",
        "peak",
        "report",
        "requests",
        "rid",
        "t",
    )

    def __init__(self, t: float, r: StatsReport, slo_ms: float) -> None:
        self.t, self.report, self.rid = t, r, r.replica_id
        self.peak = max(r.mem_peak_bytes, r.mem_used_bytes)
        self.lat = r.latency_ms
        self.completions = r.completions
        self.misses = r.rejections + r.timeouts
        self.counted = r.completions + r.rejections + r.timeouts + r.errors
        self.batches = r.batches
        paired = r.batches[: len(r.batch_requests)]  # a batch counts toward cost with its request count
        self.cost = sum(cost for cost, _ in paired)
        self.requests = sum(r.batch_requests[: len(paired)])
        self.max_cost = max((cost for cost, _ in paired), default=0.0)
        self.n_batches = len(r.batches)
        self.emergency = r.emergency_shrinks > 0
        self.oom_splits = r.oom_splits
        self.oom_costs = r.oom_costs
        self.arrivals, self.interval, self.busy_s = r.arrivals, r.interval_s, r.busy_s
        self.met = 0.0
        self.rate(slo_ms)

    def rate(self, slo_ms: float) -> None:
        """Requests answered within ``slo_ms`` (``broker.attainment``), for the window's cap."""
        r = self.report
        self.met = met_and_total(r.latency_ms, r.completions, r.rejections, r.timeouts, r.errors, slo_ms)[0]


class _ModelWindow:
    """One model's reports over its window, with what a snapshot needs kept current as reports
    arrive and leave: each replica's newest report, and sliding maxima (each replica's peak
    memory, the biggest batch) as monotonic queues, so a snapshot costs C-level sums over the
    window plus a walk over its last few seconds, not a re-fold of every report."""

    __slots__ = (
        "events",
        "fit_drops",
        "fit_n",
        "fit_own",
        "fit_pts",
        "fit_sums",
        "fit_window",
        "counted_sum",
        "latest",
        "lat_add",
        "lat_capped",
        "lat_del",
        "lat_sorted",
        "lat_total",
        "nbatch_sum",
        "requests_sum",
        "timings",
        "max_costs",
        "oom",
        "peaks",
        "rate_acc",
        "rate_lat",
        "rate_q",
        "slo_ms",
    )

    def __init__(self, slo_ms: float, fit_window: int) -> None:
        self.events: deque[_Digest] = deque()
        self.latest: dict[str, _Digest] = {}  # replica -> its newest report in the window
        self.peaks: dict[str, deque[_Digest]] = {}  # replica -> reports with decreasing peak memory
        self.max_costs: deque[_Digest] = deque()  # reports with decreasing biggest batch
        self.oom = 0  # reports in the window that carry OOM costs
        self.slo_ms = slo_ms  # the cap every digest's ``met`` was counted against
        # the L(b) fit's points: the window's last ``fit_window`` batches (and the report each came
        # in), with their sums kept as points come and go (broker.latency_model.fit_from_sums)
        self.fit_window = fit_window
        self.fit_pts: deque[tuple[float, float]] = deque()
        self.fit_own: deque[_Digest] = deque()
        self.fit_n = 0
        self.fit_sums = [0.0, 0.0, 0.0, 0.0]  # sum b, sum ms, sum b^2, sum b*ms over valid points
        self.fit_drops = 0  # points subtracted since the sums were last re-added from scratch
        self.timings: tuple[tuple[float, float], ...] | None = ()  # tuple(fit_pts); None: rebuild
        self.lat_sorted: list[float] | None = []  # the window's latencies, ascending; None: rebuild
        # samples that came and went since ``lat_sorted`` was brought up to date (merged in by bisect)
        self.lat_add: list[float] = []
        self.lat_del: list[float] = []
        self.lat_total = 0  # samples in the window
        self.lat_capped = False  # lat_sorted holds only the newest MAX_LATENCY_SAMPLES
        self.counted_sum = self.requests_sum = self.nbatch_sum = 0  # the window's integer sums
        # the rate window's reports and, per replica, their running sums: arrivals, completions,
        # rejects + timeouts, busy_s, interval_s, reports
        self.rate_q: deque[_Digest] = deque()
        self.rate_acc: dict[str, list[float]] = {}
        self.rate_lat: list[float] | None = []  # the rate window's latencies, ascending; None: rebuild

    def add(self, d: _Digest) -> None:
        self.events.append(d)
        self.latest[d.rid] = d
        q = self.peaks.get(d.rid)
        if q is None:
            q = self.peaks[d.rid] = deque()
        while q and q[-1].peak <= d.peak:
            q.pop()
        q.append(d)
        while self.max_costs and self.max_costs[-1].max_cost <= d.max_cost:
            self.max_costs.pop()
        self.max_costs.append(d)
        if d.oom_costs:
            self.oom += 1
        self.counted_sum += d.counted
        self.requests_sum += d.requests
        self.nbatch_sum += d.n_batches
        if d.lat:
            self.rate_lat = None
            self.lat_total += len(d.lat)
            if self.lat_sorted is not None:
                self.lat_add.extend(d.lat)
        if d.batches:
            self.timings = None
        self.rate_q.append(d)
        acc = self.rate_acc.get(d.rid)
        if acc is None:
            acc = self.rate_acc[d.rid] = [0, 0, 0, 0.0, 0.0, 0]
        acc[0] += d.arrivals
        acc[1] += d.completions
        acc[2] += d.misses
        acc[3] += d.busy_s
        acc[4] += d.interval
        acc[5] += 1
        sums = self.fit_sums
        for b, ms in d.batches:
            self.fit_pts.append((b, ms))
            self.fit_own.append(d)
            if b > 0 and ms >= 0:
                self.fit_n += 1
                sums[0] += b
                sums[1] += ms
                sums[2] += b * b
                sums[3] += b * ms
        while len(self.fit_pts) > self.fit_window:
            self._drop_point()

    def _drop_point(self) -> None:
        self.timings = None
        b, ms = self.fit_pts.popleft()
        self.fit_own.popleft()
        if b > 0 and ms >= 0:
            self.fit_n -= 1
            sums = self.fit_sums
            sums[0] -= b
            sums[1] -= ms
            sums[2] -= b * b
            sums[3] -= b * ms
            self.fit_drops += 1

    def fit_sums_now(self) -> tuple[int, float, float, float, float]:
        if self.fit_drops > 8 * self.fit_window or self.fit_n == 0:  # bound the float drift of add-and-subtract
            n, sb, sl, sbb, sbl = fit_sums(self.fit_pts)
            self.fit_n, self.fit_sums, self.fit_drops = n, [sb, sl, sbb, sbl], 0
        return (self.fit_n, *self.fit_sums)

    def advance_rate(self, from_s: float) -> None:
        """Reports older than ``from_s`` leave the rate window (and its sums)."""
        q = self.rate_q
        while q and q[0].t < from_s:
            d = q.popleft()
            acc = self.rate_acc[d.rid]
            if acc[5] <= 1:  # its last report here: drop the sums rather than keep float remainders
                del self.rate_acc[d.rid]
            else:
                acc[0] -= d.arrivals
                acc[1] -= d.completions
                acc[2] -= d.misses
                acc[3] -= d.busy_s
                acc[4] -= d.interval
                acc[5] -= 1
            if d.lat:
                self.rate_lat = None

    def rate_latencies(self) -> list[float]:
        if self.rate_lat is None:
            lat = list(chain.from_iterable(map(_LAT, self.rate_q)))
            lat.sort()
            self.rate_lat = lat
        return self.rate_lat

    def batch_timings(self) -> tuple[tuple[float, float], ...]:
        if self.timings is None:
            self.timings = tuple(self.fit_pts)
        return self.timings

    def latencies(self) -> list[float]:
        """The window's latency samples (the newest ``MAX_LATENCY_SAMPLES``), ascending; rebuilt
        only when a report with samples came or went."""
        lat = self.lat_sorted
        if lat is not None and (self.lat_add or self.lat_del):
            gone, came = self.lat_del, self.lat_add
            self.lat_add, self.lat_del = [], []
            if self.lat_capped or self.lat_total > MAX_LATENCY_SAMPLES:
                lat = None  # over the cap: the newest samples are kept, which takes the window's order
            else:
                for v in gone:
                    i = bisect_left(lat, v)
                    if i < len(lat) and lat[i] == v:
                        del lat[i]
                    else:  # not found (a NaN): rebuild
                        lat = None
                        break
                else:
                    lat.extend(came)
                    lat.sort()  # one sorted run and a short tail: a merge
        if lat is None:
            self.lat_add, self.lat_del = [], []
            lat = list(chain.from_iterable(map(_LAT, self.events)))
            self.lat_capped = len(lat) > MAX_LATENCY_SAMPLES
            if self.lat_capped:
                lat = lat[-MAX_LATENCY_SAMPLES:]
            lat.sort()
        self.lat_sorted = lat
        return lat

    def set_fit_window(self, fit_window: int) -> None:
        self.fit_window = fit_window
        while len(self.fit_pts) > fit_window:
            self._drop_point()

    def evict(self, before_s: float) -> None:
        events = self.events
        while events and events[0].t < before_s:
            d = events.popleft()
            q = self.peaks[d.rid]
            if q[0] is d:
                q.popleft()
                if not q:
                    del self.peaks[d.rid]
            if self.max_costs and self.max_costs[0] is d:
                self.max_costs.popleft()
            if d.oom_costs:
                self.oom -= 1
            self.counted_sum -= d.counted
            self.requests_sum -= d.requests
            self.nbatch_sum -= d.n_batches
            if d.lat:
                self.lat_total -= len(d.lat)
                if self.lat_sorted is not None:
                    self.lat_del.extend(d.lat)
            if self.latest.get(d.rid) is d:
                del self.latest[d.rid]
            while self.fit_own and self.fit_own[0] is d:
                self._drop_point()

    def recount(self, slo_ms: float) -> None:
        if slo_ms != self.slo_ms:
            for d in self.events:
                d.rate(slo_ms)
            self.slo_ms = slo_ms


_LAT, _OOM = attrgetter("lat"), attrgetter("oom_costs")
_MET, _COST = attrgetter("met"), attrgetter("cost")


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
        # the window's sums: kept as reports come and go, or summed in C over the digests
        latencies = mw.latencies()
        oom_costs = tuple(chain.from_iterable(map(_OOM, events))) if mw.oom else ()  # the ceiling stays below them
        met = sum(map(_MET, events))
        counted = mw.counted_sum
        batch_cost = sum(map(_COST, events))
        batch_requests = mw.requests_sum
        batches = mw.nbatch_sum
        max_cost = mw.max_costs[0].max_cost if mw.max_costs else 0.0  # the batch behind the window's peak
        emergency = False
        oom_splits = 0
        recent_acc: dict[str, list[float]] = {}
        for d in reversed(events):  # the last report or two of each replica, and those since the last snapshot
            t = d.t
            if t < recent_from and t <= since_s:
                break
            if t > since_s:
                emergency = emergency or d.emergency
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
        edge = self._edge[name]
        if edge:
            while edge and edge[0][0] < now_s - window_s:
                edge.popleft()
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
        return build(  # ModelLoad(...) without the frozen __init__ (broker.records)
            ModelLoad,
            name=name,
            replicas=len(seen),
            queue_depth=float(queue),
            arrival_rate_rps=arrival,
            recent_arrival_rate_rps=recent_rate,
            completion_rate_rps=completion,
            reject_rate_rps=reject + edge_recent / self._rate_s,
            p50_ms=percentile(latencies, 50),
            p95_ms=percentile(latencies, 95),
            p99_ms=percentile(latencies, 99),
            latency_samples=len(latencies),
            recent_p95_ms=percentile(recent, 95),
            recent_samples=len(recent),
            attainment=attainment(met, counted),
            batch_timings=mw.batch_timings(),
            fit_sums=mw.fit_sums_now(),
            mean_batch=(batch_cost / batches) if batches else 0.0,
            max_batch=max_cost,
            cost_per_request=(batch_cost / batch_requests) if batch_requests else 1.0,
            busy_frac=(busy / rated) if rated else 0.0,
            mem_used_bytes=used,
            mem_peak_bytes=peak,
            emergency=emergency,
            oom_splits=oom_splits,
            oom_costs=oom_costs,
            settings_version=version or 0,
            weights_bytes=int(memory[0]),
            bytes_per_unit=float(memory[1]),
            cost_unit=spec.batch.unit,
            replica_reports=tuple(seen),
        )
