"""Fold replicas' stats deltas into per-model load over a sliding window.

Not a policy, but pure all the same: the time of each report and of each snapshot comes in
as an argument, so the simulator and the live broker share this code. Percentiles are taken
over ``control.window_s`` (never a single sample); rates and utilisation over a shorter
window (``rate_window_s``) so the controller sees a burst within seconds.

Each report is digested once as it arrives (``Digest``); per model a ``ModelWindow`` keeps what
a snapshot needs current as reports come and go (each replica's newest report, sliding maxima,
the rate window's sums, the sorted latency samples), so a snapshot does not re-fold the window.

Each snapshot also lists, per model, every live replica (one that reported within
``stale_after_s``) with the broker time of its latest report, the settings version it ran and
the memory it measured (``ModelLoad.replica_reports``): a two-phase quota transfer completes
only on reports from all of them that arrived after it began (``gpubroker.broker.control.lending``).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Mapping, Sequence
from itertools import chain
from operator import attrgetter
from typing import NamedTuple

from gpubroker.broker.control.attainment import attainment, met_and_total
from gpubroker.broker.control.types import FleetSnapshot, GpuLoad, ModelLoad, ReplicaSeen
from gpubroker.broker.wire import StatsReport
from gpubroker.quotas.config import FleetConfig

MIN_INTERVAL_S = 1e-9  # a replica's reports covering less than this say nothing about its rates

MAX_LATENCY_SAMPLES = 20_000  # per model per window, newest kept


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending sequence (None when empty)."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values) - 1e-9) - 1))
    return sorted_values[k]


class Digest:
    """One report folded once, when it arrives: what every snapshot of its window adds up."""

    __slots__ = (
        "arrivals",
        "batches",
        "busy_s",
        "completions",
        "cost",
        "counted",
        "emergency",
        "held",
        "active",
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
        self.batches = batches = r.batches
        if batches and r.batch_requests:
            paired = batches[: len(r.batch_requests)]  # a batch counts toward cost with its request count
            self.cost = sum(cost for cost, _ in paired)
            self.requests = sum(r.batch_requests[: len(paired)])
            self.max_cost = max(cost for cost, _ in paired)
        else:  # no batch paired with a request count (most reports of an idle replica): what the sums give
            self.cost = self.requests = 0
            self.max_cost = 0.0
        self.n_batches = len(batches)
        self.emergency = r.emergency_shrinks > 0
        self.held = r.held_refusals > 0
        self.oom_splits = r.oom_splits
        self.oom_costs = r.oom_costs
        self.arrivals, self.interval, self.busy_s = r.arrivals, r.interval_s, r.busy_s
        self.met = 0.0
        # a report of an idle replica (nothing arrived, ran, missed or failed): a window of only
        # such reports has every rate, latency and batch figure empty (``gpubroker.broker.control.window``'s quiet fold)
        self.active = bool(
            self.arrivals
            or self.counted
            or self.lat
            or self.batches
            or self.busy_s
            or self.misses
            or self.emergency
            or self.held
            or self.oom_splits
            or self.oom_costs
            or r.batch_requests
        )
        if self.active:
            self.rate(slo_ms)

    def rate(self, slo_ms: float) -> None:
        """Requests answered within ``slo_ms`` (``gpubroker.broker.control.attainment``), for the window's cap."""
        r = self.report
        self.met = met_and_total(r.latency_ms, r.completions, r.rejections, r.timeouts, r.errors, slo_ms)[0]


class ModelWindow:
    """One model's reports over its window, with what a snapshot needs kept current as reports
    arrive and leave: each replica's newest report, and sliding maxima (each replica's peak
    memory, the biggest batch) as monotonic queues, so a snapshot costs C-level sums over the
    window plus a walk over its last few seconds, not a re-fold of every report."""

    __slots__ = (
        "events",
        "acts",
        "fit_own",
        "fit_pts",
        "fit_window",
        "counted_sum",
        "latest",
        "lat_add",
        "lat_capped",
        "lat_del",
        "lat_sorted",
        "lat_total",
        "met_cost",
        "met_vals",
        "cost_vals",
        "vals_head",
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
        self.events: deque[Digest] = deque()
        self.acts: deque[Digest] = deque()  # the events that carry activity (``Digest.active``), in order
        self.latest: dict[str, Digest] = {}  # replica -> its newest report in the window
        self.peaks: dict[str, deque[Digest]] = {}  # replica -> reports with decreasing peak memory
        self.max_costs: deque[Digest] = deque()  # reports with decreasing biggest batch
        self.oom = 0  # reports in the window that carry OOM costs
        self.slo_ms = slo_ms  # the cap every digest's ``met`` was counted against
        # the L(b) fit's points: the window's last ``fit_window`` batches (and the report each came in)
        self.fit_window = fit_window
        self.fit_pts: deque[tuple[float, float]] = deque()
        self.fit_own: deque[Digest] = deque()
        self.timings: tuple[tuple[float, float], ...] | None = ()  # tuple(fit_pts); None: rebuild
        self.lat_sorted = array("d")  # the window's latencies, ascending
        # samples that came and went since ``lat_sorted`` was brought up to date (merged in by bisect)
        self.lat_add: list[float] = []
        self.lat_del: list[float] = []
        self.lat_total = 0  # samples in the window
        self.lat_capped = False  # lat_sorted holds only the newest MAX_LATENCY_SAMPLES
        self.counted_sum = self.requests_sum = self.nbatch_sum = 0  # the window's integer sums
        # (met, batch cost) summed over the window in order; None: a report with either came or
        # went (reports adding 0.0 leave a float sum as it was, so only those count)
        self.met_cost: tuple[float, float] | None = (0, 0)
        # the active events' met and batch cost, in order, as contiguous doubles: a tick reads every
        # model's window once, from memory rather than the cache, and summing these reads a few
        # lines where summing the digests' attributes reads one digest and one float per report
        self.met_vals = array("d")
        self.cost_vals = array("d")
        self.vals_head = 0  # values before it left with their digests (cut off in bulk: O(1) a report)
        # the rate window's reports and, per replica, their running sums: arrivals, completions,
        # rejects + timeouts, busy_s, interval_s, reports
        self.rate_q: deque[Digest] = deque()
        self.rate_acc: dict[str, list[float]] = {}
        self.rate_lat: list[float] | None = []  # the rate window's latencies, ascending; None: rebuild

    def add(self, d: Digest) -> None:
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
        self.rate_q.append(d)
        acc = self.rate_acc.get(d.rid)
        if acc is None:
            acc = self.rate_acc[d.rid] = [0, 0, 0, 0.0, 0.0, 0]
        acc[4] += d.interval
        acc[5] += 1
        if not d.active:  # an idle report: nothing for the sums, the samples or the fit
            return
        self.acts.append(d)
        self.met_vals.append(d.met)
        self.cost_vals.append(d.cost)
        acc[0] += d.arrivals
        acc[1] += d.completions
        acc[2] += d.misses
        acc[3] += d.busy_s
        if d.oom_costs:
            self.oom += 1
        self.counted_sum += d.counted
        self.requests_sum += d.requests
        self.nbatch_sum += d.n_batches
        if d.lat:
            self.rate_lat = None
            self.lat_total += len(d.lat)
            self.lat_add.extend(d.lat)
        if d.batches:
            self.timings = None
        if d.met or d.cost:
            self.met_cost = None
        for point in d.batches:
            self.fit_pts.append(point)
            self.fit_own.append(d)
        while len(self.fit_pts) > self.fit_window:
            self._drop_point()

    def _drop_point(self) -> None:
        self.timings = None
        self.fit_pts.popleft()
        self.fit_own.popleft()

    def advance_rate(self, from_s: float) -> None:
        """Reports older than ``from_s`` leave the rate window (and its sums)."""
        q = self.rate_q
        while q and q[0].t < from_s:
            d = q.popleft()
            acc = self.rate_acc[d.rid]
            if acc[5] <= 1:  # its last report here: drop the sums rather than keep float remainders
                del self.rate_acc[d.rid]
            elif not d.active:  # an idle report added only its interval
                acc[4] -= d.interval
                acc[5] -= 1
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

    def latencies(self) -> array:
        """The window's latency samples (the newest ``MAX_LATENCY_SAMPLES``), ascending, as
        contiguous doubles (a list would be one float object per sample, spread over the heap,
        and the tick reads every model's window from memory rather than the cache): the samples
        that came and went merged in by bisection, or a rebuild over the cap."""
        lat: array | None = self.lat_sorted
        if self.lat_add or self.lat_del:
            gone, came = self.lat_del, self.lat_add
            self.lat_add, self.lat_del = [], []
            if self.lat_capped or self.lat_total > MAX_LATENCY_SAMPLES:
                lat = None  # over the cap: the newest samples are kept, which takes the window's order
            else:
                cur = lat
                assert cur is not None  # built at the first read; samples come and go only after it
                for v in gone:
                    i = bisect_left(cur, v)
                    if i < len(cur) and cur[i] == v:
                        del cur[i]
                    else:  # not found (a NaN): rebuild
                        lat = None
                        break
                else:  # each after its equals, as a stable sort of the extended list would put it
                    for v in came:
                        if v != v:  # a NaN: rebuild
                            lat = None
                            break
                        insort(cur, v)
        if lat is None:
            vals = list(chain.from_iterable(map(_LAT, self.acts)))  # idle events carry none
            self.lat_capped = len(vals) > MAX_LATENCY_SAMPLES
            if self.lat_capped:
                vals = vals[-MAX_LATENCY_SAMPLES:]
            vals.sort()
            lat = array("d", vals)
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
            if self.latest.get(d.rid) is d:
                del self.latest[d.rid]
            if not d.active:  # an idle report added nothing to the sums, the samples or the fit
                continue
            self.acts.popleft()  # d: the oldest active event
            self.vals_head += 1
            if self.vals_head >= 64 and 2 * self.vals_head >= len(self.met_vals):
                del self.met_vals[: self.vals_head], self.cost_vals[: self.vals_head]
                self.vals_head = 0
            if d.oom_costs:
                self.oom -= 1
            if d.met or d.cost:
                self.met_cost = None
            self.counted_sum -= d.counted
            self.requests_sum -= d.requests
            self.nbatch_sum -= d.n_batches
            if d.lat:
                self.lat_total -= len(d.lat)
                self.lat_del.extend(d.lat)
            while self.fit_own and self.fit_own[0] is d:
                self._drop_point()

    def recount(self, slo_ms: float) -> None:
        if slo_ms != self.slo_ms:
            for d in self.acts:  # an idle report's met is 0.0 at any cap
                d.rate(slo_ms)
            self.met_vals, self.cost_vals = array("d", map(_MET, self.acts)), array("d", map(_COST, self.acts))
            self.vals_head = 0
            self.slo_ms = slo_ms
            self.met_cost = None

    def sums_met_cost(self) -> tuple[float, float]:
        if self.met_cost is None:
            # Over the active events only: an idle one adds met 0.0 and cost 0, which leave a
            # left-to-right float sum as it was, so these are the sums over every event.
            met, cost, head = self.met_vals, self.cost_vals, self.vals_head
            if head:  # the values of digests that left, not yet cut off
                met, cost = met[head:], cost[head:]
            self.met_cost = (sum(met), sum(cost))  # the same left-to-right sums
        return self.met_cost


_LAT, _OOM = attrgetter("lat"), attrgetter("oom_costs")
_MET, _COST = attrgetter("met"), attrgetter("cost")


def stale_after_s(config: FleetConfig) -> float:
    """A replica that has not reported for this long is not live (five report intervals, at least 2 s)."""
    return max(2.0, 5.0 * config.broker.report_interval_s)


class LiveReplicas(NamedTuple):
    """A model's live replicas (a report within ``stale_after_s``), their newest reports summed."""

    queue: int  # queue depths
    used: int  # memory used now
    peak: int  # each replica's peak over the window
    version: int | None  # the lowest settings version they run (None: no live replica)
    seen: tuple[ReplicaSeen, ...]  # in replica id order


class RecentReports(NamedTuple):
    """What the reports since the last snapshot, or of the last ~2 report intervals, say."""

    emergency: bool  # a fast-loop shrink since the last snapshot
    held: bool  # a refusal over the grant since the last snapshot
    oom_splits: int  # since the last snapshot
    arrival_rate_rps: float  # over the last ~2 report intervals, summed over replicas


class ReportWindow:
    def __init__(self, config: FleetConfig):
        self._events: dict[str, ModelWindow] = {}
        # rejections at the ingress (Serve queue full, replica gone)
        self._edge: dict[str, deque[tuple[float, int]]] = {}
        self._last_snapshot_s = float("-inf")
        self._slo_ms: dict[str, float] = {}  # effective P95 caps of the last snapshot call
        self.reconfigure(config)

    def reconfigure(self, config: FleetConfig) -> None:
        self._config = config
        for name, spec in config.models.items():
            window = self._events.setdefault(
                name, ModelWindow(self._slo_ms.get(name, spec.slo_p95_ms), spec.control.fit_window)
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
        window.add(Digest(received_s, report, window.slo_ms))
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
        attainment (``gpubroker.broker.control.attainment``) is measured against it, else against ``slo_p95_ms``."""
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
        """One model's load: the window aged to ``now_s``, then folded (or, with no activity, the quiet fold)."""
        spec = self._config.models[name]
        window_s = spec.control.window_s
        mw = self._events[name]
        mw.evict(now_s - window_s)
        mw.recount(self._slo_ms.get(name, spec.slo_p95_ms))
        rate_from = now_s - self._rate_s
        mw.advance_rate(max(rate_from, now_s - window_s))
        live = _live_replicas(mw, now_s - self._stale_s)
        edge = self._edge[name]
        while edge and edge[0][0] < now_s - window_s:
            edge.popleft()
        if not mw.acts and not edge:
            return self._quiet_load(name, spec.batch.unit, mw, live, memory)
        recent = _recent_reports(mw.events, since_s, now_s - self._recent_s)
        # the window's sums: kept as reports come and go, or summed in C over the digests
        latencies = mw.latencies()
        met, batch_cost = mw.sums_met_cost()
        counted, edge_recent = mw.counted_sum, 0
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
        rate_latencies = mw.rate_latencies()
        batches, batch_requests = mw.nbatch_sum, mw.requests_sum
        return ModelLoad(
            name=name,
            replicas=len(live.seen),
            queue_depth=float(live.queue),
            arrival_rate_rps=arrival,
            recent_arrival_rate_rps=recent.arrival_rate_rps,
            completion_rate_rps=completion,
            reject_rate_rps=reject + edge_recent / self._rate_s,
            p50_ms=percentile(latencies, 50),
            p95_ms=percentile(latencies, 95),
            p99_ms=percentile(latencies, 99),
            latency_samples=len(latencies),
            recent_p95_ms=percentile(rate_latencies, 95),
            recent_samples=len(rate_latencies),
            attainment=attainment(met, counted),
            batch_timings=mw.batch_timings(),
            mean_batch=(batch_cost / batches) if batches else 0.0,
            max_batch=mw.max_costs[0].max_cost if mw.max_costs else 0.0,  # the batch behind the window's peak
            cost_per_request=(batch_cost / batch_requests) if batch_requests else 1.0,
            busy_frac=(busy / rated) if rated else 0.0,
            mem_used_bytes=live.used,
            mem_peak_bytes=live.peak,
            emergency=recent.emergency,
            held_over=recent.held,
            oom_splits=recent.oom_splits,
            # the memory ceiling stays below every batch that ran out of memory in the window
            oom_costs=tuple(chain.from_iterable(map(_OOM, mw.events))) if mw.oom else (),
            settings_version=live.version or 0,
            weights_bytes=int(memory[0]),
            bytes_per_unit=float(memory[1]),
            cost_unit=spec.batch.unit,
            replica_reports=live.seen,
        )

    @staticmethod
    def _quiet_load(name: str, unit: str, mw: ModelWindow, live: LiveReplicas, memory: tuple[int, float]) -> ModelLoad:
        """The load of a window whose reports carry no activity (``Digest.active``) and no
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
            replicas=len(live.seen),
            queue_depth=float(live.queue),
            attainment=attainment(met, mw.counted_sum),
            batch_timings=mw.batch_timings(),
            max_batch=mw.max_costs[0].max_cost if mw.max_costs else 0.0,
            busy_frac=(busy / rated) if rated else 0.0,
            mem_used_bytes=live.used,
            mem_peak_bytes=live.peak,
            settings_version=live.version or 0,
            weights_bytes=int(memory[0]),
            bytes_per_unit=float(memory[1]),
            cost_unit=unit,
            replica_reports=live.seen,
        )


def _live_replicas(mw: ModelWindow, live_from: float) -> LiveReplicas:
    """Each live replica's newest report (one that came at or after ``live_from``), in id order."""
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
    return LiveReplicas(queue, used, peak, version, tuple(seen))


def _recent_reports(events: deque[Digest], since_s: float, recent_from: float) -> RecentReports:
    """The last report or two of each replica, and those since the last snapshot (newest first)."""
    emergency = held = False
    oom_splits = 0
    recent_acc: dict[str, list[float]] = {}
    for d in reversed(events):
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
    return RecentReports(emergency, held, oom_splits, recent_rate)
