"""The report window's per-model fold (``broker.control.window``): each report digested once as it
arrives (``_Digest``), and per model (``_ModelWindow``) what a snapshot needs kept current as
reports come and go: each replica's newest report, sliding maxima as monotonic queues, the
rate window's and the fit's running sums, the sorted latency samples merged rather than
re-sorted. Pure: times come in as arguments."""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, insort
from collections import deque
from itertools import chain
from operator import attrgetter

from broker.control.attainment import met_and_total
from broker.control.latency_model import fit_sums
from broker.wire import StatsReport

MAX_LATENCY_SAMPLES = 20_000  # per model per window, newest kept


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values) - 1e-9) - 1))
    return sorted_values[k]


def tail_percentiles(sorted_values: list[float]) -> tuple[float | None, float | None, float | None]:
    """``percentile`` at 50, 95 and 99 in one call (the snapshot asks all three per model)."""
    n = len(sorted_values)
    if not n:
        return None, None, None
    top = n - 1
    return (
        sorted_values[max(0, min(top, math.ceil(0.5 * n - 1e-9) - 1))],
        sorted_values[max(0, min(top, math.ceil(0.95 * n - 1e-9) - 1))],
        sorted_values[max(0, min(top, math.ceil(0.99 * n - 1e-9) - 1))],
    )


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
        # such reports has every rate, latency and batch figure empty (``broker.control.window``'s quiet fold)
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
        """Requests answered within ``slo_ms`` (``broker.control.attainment``), for the window's cap."""
        r = self.report
        self.met = met_and_total(r.latency_ms, r.completions, r.rejections, r.timeouts, r.errors, slo_ms)[0]


class _ModelWindow:
    """One model's reports over its window, with what a snapshot needs kept current as reports
    arrive and leave: each replica's newest report, and sliding maxima (each replica's peak
    memory, the biggest batch) as monotonic queues, so a snapshot costs C-level sums over the
    window plus a walk over its last few seconds, not a re-fold of every report."""

    __slots__ = (
        "events",
        "acts",
        "fit_drops",
        "fit_n",
        "fit_max",
        "fit_own",
        "fit_pts",
        "fit_seq",
        "fit_sums",
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
        self.events: deque[_Digest] = deque()
        self.acts: deque[_Digest] = deque()  # the events that carry activity (``_Digest.active``), in order
        self.latest: dict[str, _Digest] = {}  # replica -> its newest report in the window
        self.peaks: dict[str, deque[_Digest]] = {}  # replica -> reports with decreasing peak memory
        self.max_costs: deque[_Digest] = deque()  # reports with decreasing biggest batch
        self.oom = 0  # reports in the window that carry OOM costs
        self.slo_ms = slo_ms  # the cap every digest's ``met`` was counted against
        # the L(b) fit's points: the window's last ``fit_window`` batches (and the report each came
        # in), with their sums kept as points come and go (broker.control.latency_model.fit_from_sums)
        self.fit_window = fit_window
        self.fit_pts: deque[tuple[float, float]] = deque()
        self.fit_own: deque[_Digest] = deque()
        # the biggest batch cost among the fit's points, as a monotonic queue of (cost, point number)
        self.fit_max: deque[tuple[float, int]] = deque()
        self.fit_seq = [0, 0]  # numbers of the oldest point kept and of the next point
        self.fit_n = 0
        self.fit_sums = [0.0, 0.0, 0.0, 0.0]  # sum b, sum ms, sum b^2, sum b*ms over valid points
        self.fit_drops = 0  # points subtracted since the sums were last re-added from scratch
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
        sums, top, seq = self.fit_sums, self.fit_max, self.fit_seq
        for b, ms in d.batches:
            self.fit_pts.append((b, ms))
            self.fit_own.append(d)
            while top and top[-1][0] <= b:
                top.pop()
            top.append((b, seq[1]))
            seq[1] += 1
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
        seq = self.fit_seq
        if self.fit_max[0][1] == seq[0]:
            self.fit_max.popleft()
        seq[0] += 1
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
                for v in gone:
                    i = bisect_left(lat, v)
                    if i < len(lat) and lat[i] == v:
                        del lat[i]
                    else:  # not found (a NaN): rebuild
                        lat = None
                        break
                else:  # each after its equals, as a stable sort of the extended list would put it
                    for v in came:
                        if v != v:  # a NaN: rebuild
                            lat = None
                            break
                        insort(lat, v)
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

    def biggest_fit_cost(self) -> float | None:
        """The biggest batch cost among the fit's points (None: no points)."""
        return self.fit_max[0][0] if self.fit_max else None


_LAT, _OOM = attrgetter("lat"), attrgetter("oom_costs")
_MET, _COST = attrgetter("met"), attrgetter("cost")
