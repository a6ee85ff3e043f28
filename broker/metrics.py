"""Prometheus metrics of the broker, and the ``/metrics`` exporter.

``BrokerMetrics`` owns every metric the broker exports; the broker calls three methods:

* ``observe_report(report)`` for each replica stats report (request outcomes, latency and
  batch-size histograms, OOM splits, emergency shrinks);
* ``observe_tick(decision, status, tick_s)`` at the end of each slow-loop tick (gauges from the
  status dict, decision and quota-transfer counters, tick duration);
* ``observe_reload(ok, config_hash)`` after each ``apply``.

Labels are ``model`` (a config key) and ``gpu`` (the config's device) plus small fixed
enumerations (``outcome``, ``kind``, ``trigger``, ``profile``): never anything taken from a
request, so the series count is bounded by the config. Unknown enumeration values are
folded into ``other``.

The registry is injected (``CollectorRegistry()`` in tests, STYLE item 9). A metrics failure
is logged and never propagates into the broker: metrics are a side channel.

``start_exporter(metrics, host, port)`` serves the registry at ``http://host:port/metrics``
from a daemon thread in the broker's process; port 0 disables it, and a port already in use
is logged as an error and leaves the broker running without an exporter.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info

from broker.wire import FleetDecision, StatsReport

logger = logging.getLogger("gpubroker.metrics")

PREFIX = "gpubroker_"

# Fixed label enumerations: anything else is counted as "other".
OUTCOMES = ("ok", "rejected", "timeout", "shed", "error")  # shed: 504 at once, too late for the SLO
MOVE_KINDS = (
    "lend",
    "reclaim",
    "confirm",
    "grow",
    "release",
    "abort",
    "reclaim_cache",
    "reclaim_drain",
    "reclaim_restart",
)
TRIGGERS = ("queue_depth", "p95_ms", "free_frac", "arrival_rate_rps", "sm_util_frac", "hold")

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TICK_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

_F = TypeVar("_F", bound=Callable[..., Any])


def _never_raises(fn: _F) -> _F:
    """Metrics are a side channel: log a failure, never let it reach the broker."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001
            logger.exception("metrics: %s failed (the broker carries on)", fn.__name__)
            return None

    return wrapper  # type: ignore[return-value]


def _enum(value: str, allowed: tuple[str, ...]) -> str:
    return value if value in allowed else "other"


def _num(value: Any) -> float:
    """A status value as a gauge value: None (unknown) becomes NaN, which Grafana shows as a gap."""
    if value is None:
        return math.nan
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    return float(value)


def _per(value: Any, per: float) -> float:
    """``_num(value) / per`` (milliseconds out as seconds); unknown stays the one ``math.nan``
    (ticks compare the values they set)."""
    v = _num(value)
    return v if per == 1.0 or v != v else v / per


class LlmGauges:
    """LLM engine signals per model (``broker.control.llm_window.LlmControl.status``): TTFT and TPOT
    P50/P95/P99, tokens/s in and out, running and waiting sequences, KV blocks used and free,
    preemptions, and the bounds the broker set."""

    QUANTILES = ("50", "95", "99")

    def __init__(self, r: CollectorRegistry) -> None:
        mg = ("model", "gpu")
        self.ttft = Gauge(
            f"{PREFIX}llm_ttft_seconds",
            "Time to first token over the engine's recent completions.",
            (*mg, "quantile"),
            registry=r,
        )
        self.tpot = Gauge(
            f"{PREFIX}llm_tpot_seconds",
            "Time per output token over the engine's recent completions.",
            (*mg, "quantile"),
            registry=r,
        )
        self.slo = Gauge(
            f"{PREFIX}llm_slo_seconds",
            "TTFT and TPOT P95 objectives (llm.ttft_slo_ms, llm.tpot_slo_ms).",
            (*mg, "metric"),
            registry=r,
        )
        self.tokens = Gauge(
            f"{PREFIX}llm_tokens_per_second",
            "Prompt (in) and generated (out) tokens per second.",
            (*mg, "direction"),
            registry=r,
        )
        self.seqs = Gauge(
            f"{PREFIX}llm_sequences",
            "Sequences running in the engine and waiting at its admission.",
            (*mg, "state"),
            registry=r,
        )
        self.blocks = Gauge(f"{PREFIX}llm_kv_blocks", "KV cache blocks used and free now.", (*mg, "state"), registry=r)
        self.preemptions = Gauge(
            f"{PREFIX}llm_preemptions", "Sequences evicted and recomputed since the engine started.", mg, registry=r
        )
        self.bound = Gauge(
            f"{PREFIX}llm_bound",
            "Engine bounds the broker set: max_num_seqs, max_batched_tokens, kv_blocks, prefill_paused (1 paused).",
            (*mg, "bound"),
            registry=r,
        )

    def observe(self, name: str, gpu: str, e: Mapping[str, Any]) -> None:
        for q in self.QUANTILES:
            for gauge, key in ((self.ttft, "ttft"), (self.tpot, "tpot")):
                ms = e.get(f"{key}_p{q}_ms")
                gauge.labels(name, gpu, q).set(math.nan if ms is None else ms / 1000.0)
        for metric in ("ttft", "tpot"):
            self.slo.labels(name, gpu, metric).set(_num(e.get(f"{metric}_slo_ms")) / 1000.0)
        self.tokens.labels(name, gpu, "in").set(_num(e.get("tokens_in_per_s")))
        self.tokens.labels(name, gpu, "out").set(_num(e.get("tokens_out_per_s")))
        for state in ("running", "waiting"):
            self.seqs.labels(name, gpu, state).set(_num(e.get(state)))
        self.blocks.labels(name, gpu, "used").set(_num(e.get("kv_blocks_used")))
        self.blocks.labels(name, gpu, "free").set(_num(e.get("kv_blocks_free")))
        self.preemptions.labels(name, gpu).set(_num(e.get("preemptions")))
        for bound in ("max_num_seqs", "max_batched_tokens", "kv_blocks", "prefill_paused"):
            self.bound.labels(name, gpu, bound).set(_num(e.get(bound)))

    def forget(self, name: str, gpu: str) -> None:
        for gauge in vars(self).values():  # every attribute of an instance is one of its gauges
            for labels in [k for k in list(gauge._metrics) if k[:2] == (name, gpu)]:
                gauge.remove(*labels)


class BrokerMetrics:
    """Every metric the broker exports, in one registry.

    ``registry=None`` uses prometheus_client's global ``REGISTRY`` (one instance per process);
    the broker passes its own ``CollectorRegistry()`` so a process may hold several brokers.
    ``gpu`` is the ``gpu`` label value (the config's device, e.g. ``cpu`` or ``cuda:0``).
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, gpu: str = "gpu0", clock: Callable[[], float] = time.time
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.gpu = gpu
        self._clock = clock
        self._models: set[str] = set()  # models with per-model gauge series
        self._series: dict[tuple[str, ...], Any] = {}  # (metric, labels) -> child: what ticks and reports set
        # model -> the gauge values its last tick set: the same values (most models, most ticks) skip the sets
        self._last: dict[str, tuple[float, ...]] = {}
        self._profile: str | None = None
        r = self.registry
        mg = ("model", "gpu")

        # ---- from replica reports
        self.requests = Counter(
            f"{PREFIX}requests_total",
            "Requests finished, by outcome (ok, rejected, timeout, shed: 504 too late for the SLO, error).",
            mg + ("outcome",),
            registry=r,
        )
        self.latency = Histogram(
            f"{PREFIX}request_latency_seconds",
            "End-to-end latency of completed requests (the replicas' reported samples).",
            mg,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.batch_size = Histogram(
            f"{PREFIX}batch_size", "Requests per executed batch.", mg, buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_exec = Histogram(
            f"{PREFIX}batch_execution_seconds",
            "Model execution time per batch.",
            mg,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.busy = Counter(
            f"{PREFIX}busy_seconds_total", "Seconds the replicas spent executing batches.", mg, registry=r
        )
        self.oom_splits = Counter(
            f"{PREFIX}oom_splits_total", "Batches split in two after an out-of-memory error.", mg, registry=r
        )
        self.emergency_shrinks = Counter(
            f"{PREFIX}emergency_shrinks_total",
            "Fast-loop halvings of the batch cap (memory emergency).",
            mg,
            registry=r,
        )
        self.reports = Counter(f"{PREFIX}reports_total", "Stats reports received from replicas.", mg, registry=r)

        # ---- from the status dict, each tick
        self.grant = Gauge(f"{PREFIX}quota_granted_bytes", "Memory quota granted to the model now.", mg, registry=r)
        self.base = Gauge(
            f"{PREFIX}quota_base_bytes", "The model's guaranteed quota (config quota.base).", mg, registry=r
        )
        self.used = Gauge(f"{PREFIX}quota_used_bytes", "Memory the model's replicas use now.", mg, registry=r)
        self.max_batch = Gauge(
            f"{PREFIX}max_batch_size", "Batch cap in the model's batch unit (requests or tokens).", mg, registry=r
        )
        self.wait = Gauge(f"{PREFIX}batch_wait_timeout_seconds", "Serve batch wait timeout.", mg, registry=r)
        self.queue = Gauge(f"{PREFIX}queue_depth", "Requests waiting or running, summed over replicas.", mg, registry=r)
        self.p95 = Gauge(
            f"{PREFIX}latency_p95_seconds",
            "P95 latency over the broker's sliding window (NaN: no samples).",
            mg,
            registry=r,
        )
        self.slo = Gauge(
            f"{PREFIX}slo_p95_seconds", "P95 latency cap in force (SLO x the profile's slack).", mg, registry=r
        )
        self.arrival = Gauge(
            f"{PREFIX}arrival_rate_rps", "Admitted requests per second over the window.", mg, registry=r
        )
        self.attainment = Gauge(
            f"{PREFIX}slo_attainment_ratio",
            "Share of requests in the window answered within the SLO (NaN: none).",
            mg,
            registry=r,
        )
        self.cost = Gauge(
            f"{PREFIX}cost_per_1k_requests",
            "GPU cost per 1000 completed requests at the active profile's price (NaN: no completions).",
            mg,
            registry=r,
        )
        self.admit = Gauge(
            f"{PREFIX}admit", "1 while the model admits requests, 0 while paused by an emergency.", mg, registry=r
        )
        self.replicas = Gauge(f"{PREFIX}replicas", "Replicas that reported recently.", mg, registry=r)
        self.version = Gauge(f"{PREFIX}settings_version", "Version of the model's settings.", mg, registry=r)
        self.llm = LlmGauges(r)  # kind: llm engines (status models.<name>.engine)
        self.capacity = Gauge(
            f"{PREFIX}card_capacity_bytes", "Card memory (host memory pool on cpu).", ("gpu",), registry=r
        )
        self.usable = Gauge(
            f"{PREFIX}card_usable_bytes",
            "What the ledger may grant: capacity less reserve and overhead.",
            ("gpu",),
            registry=r,
        )
        self.card_used = Gauge(
            f"{PREFIX}card_used_bytes", "Memory used on the card by the models now.", ("gpu",), registry=r
        )
        self.granted = Gauge(f"{PREFIX}card_granted_bytes", "Sum of the models' grants.", ("gpu",), registry=r)
        self.free = Gauge(
            f"{PREFIX}card_free_ratio", "Free share of the card now (NaN before the first tick).", ("gpu",), registry=r
        )
        self.profile = Gauge(
            f"{PREFIX}active_profile",
            "1 for the active price profile, 0 for profiles active before.",
            ("gpu", "profile"),
            registry=r,
        )
        self.price = Gauge(
            f"{PREFIX}price_per_gpu_hour", "Price per GPU-hour of the active profile.", ("gpu",), registry=r
        )
        self.dry_run = Gauge(f"{PREFIX}dry_run", "1 when the broker decides but applies nothing.", ("gpu",), registry=r)

        # ---- from the decision, each tick
        self.decisions = Counter(
            f"{PREFIX}decisions_total",
            "Settings changes, by the metric that triggered them (fixed set; else 'other').",
            mg + ("trigger",),
            registry=r,
        )
        self.transfers = Counter(
            f"{PREFIX}quota_transfers_total", "Quota ledger steps, by kind.", ("gpu", "kind"), registry=r
        )
        self.transfer_bytes = Counter(
            f"{PREFIX}quota_transferred_bytes_total",
            "Bytes moved by quota ledger steps, by kind.",
            ("gpu", "kind"),
            registry=r,
        )
        self.ticks = Counter(f"{PREFIX}ticks_total", "Slow-loop ticks run.", ("gpu",), registry=r)
        self.tick_duration = Histogram(
            f"{PREFIX}tick_duration_seconds",
            "Wall time of one slow-loop tick.",
            ("gpu",),
            buckets=TICK_BUCKETS_S,
            registry=r,
        )
        self.checkpoint_duration = Histogram(
            f"{PREFIX}checkpoint_write_seconds",
            "Wall time of the broker's write after a tick: a many-card fleet's one checkpoint file "
            "for every card, and the decision journal.",
            buckets=TICK_BUCKETS_S,
            registry=r,
        )

        # ---- config reloads (apply)
        self.config = Info(f"{PREFIX}config", "Hash of the config the broker runs.", registry=r)
        self.reload_ok = Gauge(
            f"{PREFIX}config_last_reload_success",
            "1 if the last config load (start-up or apply) succeeded, 0 if the last apply was refused.",
            registry=r,
        )
        self.reload_time = Gauge(
            f"{PREFIX}config_last_reload_timestamp_seconds",
            "Epoch time of the last config load (start-up or apply).",
            registry=r,
        )
        self.reload_failures = Counter(f"{PREFIX}config_reload_failures_total", "Refused applies.", registry=r)
        self.reload_ok.set(1)  # the broker only starts on a valid config
        self.reload_time.set(self._clock())

    # ---------------------------------------------------------------- reports
    @_never_raises
    def observe_rejections(self, model: str, count: int) -> None:
        """Requests the ingress refused before a replica saw them (Serve queue full, replica gone)."""
        self.requests.labels(model, self.gpu, "rejected").inc(count)

    @_never_raises
    def observe_report(self, report: StatsReport) -> None:
        """Fold one replica's stats delta into the counters and histograms."""
        lab = (report.model, self.gpu)
        child = self._child  # a model's series are kept between reports, as between ticks
        child(self.reports, *lab).inc()
        counts = (report.completions, report.rejections, report.timeouts - report.shed, report.shed, report.errors)
        for outcome, n in zip(OUTCOMES, counts):
            series = child(self.requests, *lab, outcome)  # created at 0 so rate() works from the start
            if n > 0:
                series.inc(n)
        hist = child(self.latency, *lab)
        for ms in report.latency_ms:
            hist.observe(ms / 1000.0)
        sizes = child(self.batch_size, *lab)
        for n in report.batch_requests:
            sizes.observe(n)
        exec_hist = child(self.batch_exec, *lab)
        for _cost, ms in report.batches:
            exec_hist.observe(ms / 1000.0)
        child(self.busy, *lab).inc(max(0.0, report.busy_s))
        child(self.oom_splits, *lab).inc(max(0, report.oom_splits))
        child(self.emergency_shrinks, *lab).inc(max(0, report.emergency_shrinks))

    def for_gpu(self, gpu: str) -> BrokerMetrics:
        """The same series under another ``gpu`` label: one view per card of a many-card fleet,
        all in this registry (``broker.fleet_core``)."""
        view = copy.copy(self)
        view.gpu = gpu
        view._models = set()
        view._series = {}
        view._last = {}
        view._profile = None
        return view

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept: a tick sets some 17 series a model and a report about
        11, and ``labels`` takes a lock and builds a key each time. ``_forget_model`` drops a model's."""
        key = (metric._name, *labels)  # noqa: SLF001 - the metric's own name keys its children
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(*labels)
        return child

    # ---------------------------------------------------------------- ticks
    @_never_raises
    def observe_tick(self, decision: FleetDecision, status: Mapping[str, Any], tick_s: float) -> None:
        """Gauges from ``status`` (BrokerCore.status() shape), counters from ``decision``."""
        g = self.gpu
        models = status.get("models", {})
        child = self._child
        gauges = self._model_gauges()
        for name, m in models.items():
            values = tuple(_per(m.get(key, default), per) for _, key, per, default in gauges)
            # a NaN is the one ``math.nan`` (``_per``): another would only cost sets not needed
            if self._last.get(name) != values:
                for (gauge, *_), v in zip(gauges, values):
                    child(gauge, name, g).set(v)
                self._last[name] = values
            if m.get("engine") is not None:
                self.llm.observe(name, g, m["engine"])
        for gone in self._models - set(models):
            self._forget_model(gone)
        self._models = set(models)

        self.capacity.labels(g).set(_num(status.get("capacity_bytes")))
        self.usable.labels(g).set(_num(status.get("usable_bytes")))
        self.card_used.labels(g).set(_num(status.get("used_bytes")))
        self.granted.labels(g).set(_num(status.get("granted_bytes")))
        self.free.labels(g).set(_num(status.get("free_frac")))
        self.price.labels(g).set(_num(status.get("price_per_gpu_hour")))
        self.dry_run.labels(g).set(_num(bool(status.get("dry_run", False))))
        profile = str(status.get("profile") or decision.profile)
        if profile != self._profile:
            if self._profile is not None:
                self.profile.labels(g, self._profile).set(0)
            self.profile.labels(g, profile).set(1)
            self._profile = profile
        if status.get("config_hash"):
            self.config.info({"config_hash": str(status["config_hash"])})

        for name, md in decision.models.items():
            counter = self._child(self.decisions, name, g, _enum(md.trigger, TRIGGERS))
            if md.changed:
                counter.inc()
        for move in decision.moves:
            kind = _enum(move.kind, MOVE_KINDS)
            self.transfers.labels(g, kind).inc()
            self.transfer_bytes.labels(g, kind).inc(max(0, move.amount_bytes))
        self.ticks.labels(g).inc()
        self.tick_duration.labels(g).observe(max(0.0, tick_s))

    def _model_gauges(self) -> tuple[tuple[Any, str, float, Any], ...]:
        """(gauge, the status field it shows, divisor, default) for each per-model gauge a tick sets."""
        return (
            (self.grant, "grant_bytes", 1.0, None),
            (self.base, "base_bytes", 1.0, None),
            (self.used, "used_bytes", 1.0, None),
            (self.max_batch, "max_batch_size", 1.0, None),
            (self.wait, "batch_wait_timeout_s", 1.0, None),
            (self.queue, "queue_depth", 1.0, None),
            (self.p95, "p95_ms", 1000.0, None),  # gauges in seconds
            (self.slo, "slo_p95_ms", 1000.0, None),
            (self.arrival, "arrival_rate_rps", 1.0, None),
            (self.attainment, "attainment", 1.0, None),
            (self.cost, "cost_per_1k_requests", 1.0, None),
            (self.admit, "admit", 1.0, True),
            (self.replicas, "replicas", 1.0, None),
            (self.version, "settings_version", 1.0, None),
        )

    def _forget_model(self, name: str) -> None:
        """Drop a model's gauge series once it is no longer in the config (counters keep their history)."""
        for gauge, *_ in self._model_gauges():
            try:
                gauge.remove(name, self.gpu)
            except KeyError:
                pass
        self._series = {k: v for k, v in self._series.items() if k[1] != name}
        self._last.pop(name, None)
        self.llm.forget(name, self.gpu)

    @_never_raises
    def observe_checkpoint(self, write_s: float) -> None:
        """The fleet's write after a tick (``broker.fleet_store``); cards' ticks time their own step."""
        self.checkpoint_duration.observe(max(0.0, write_s))

    # ---------------------------------------------------------------- reloads
    @_never_raises
    def observe_reload(self, ok: bool, config_hash: str) -> None:
        """One ``apply``: success flag and time; on failure a counter; ``config_hash`` is the hash in force after it."""
        self.reload_ok.set(1 if ok else 0)
        self.reload_time.set(self._clock())
        if not ok:
            self.reload_failures.inc()
        if config_hash:
            self.config.info({"config_hash": str(config_hash)})

    # ---------------------------------------------------------------- helpers
    def sample_names(self) -> set[str]:
        """Every sample name the registry exports now (``_bucket``/``_sum``/``_count``/``_total``/``_info`` included)."""
        return {s.name for fam in self.registry.collect() for s in fam.samples}


from broker.metrics_export import Exporter, NullMetrics, start_exporter  # noqa: E402,F401 - re-exported
