"""Prometheus metrics of the broker, the ``/metrics`` exporter, and metrics that record nothing.

``BrokerMetrics`` owns every metric the broker exports; the broker calls three methods:

* ``observe_report(report)`` for each replica stats report (request outcomes, latency and
  batch-size histograms, OOM splits, emergency shrinks, an LLM engine's token counts);
* ``observe_tick(decision, status, tick_s)`` at the end of each slow-loop tick (gauges from the
  status dict, decision and quota-transfer counters, tick duration);
* ``observe_reload(ok, config_hash)`` after each ``apply``.

Prometheus conventions: counts are counters (``_total``; read them with ``rate()``), latencies
are histograms in seconds, each metric has one unit (``_bytes``, ``_seconds``, ``_ratio`` for
0..1), and the windowed quantiles the policy reads are gauges with a ``quantile`` label, as a
summary exports them. Every metric is one row of a table below (``Spec``).

Labels are ``model`` (a config key) and ``gpu`` (the config's device) plus small fixed
enumerations (``outcome``, ``kind``, ``trigger``, ``profile``, ``quantile``, ``state``): never
anything taken from a request, so the series count is bounded by the config. Unknown
enumeration values are folded into ``other``.

The registry is injected (``CollectorRegistry()`` in tests, STYLE item 9). A metrics failure
is logged and never propagates into the broker: metrics are a side channel.
``start_exporter(metrics, host, port)`` serves the registry from a daemon thread in the broker's
process; ``NullMetrics`` is the simulator's, which records nothing.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info

from gpubroker.broker.control.types import FleetDecision
from gpubroker.broker.wire import EngineReport, StatsReport

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
QUANTILES = (("0.5", "50"), ("0.95", "95"), ("0.99", "99"))  # (quantile label, the status field's pNN)

# Model serving: a few ms (small nets) to tens of seconds (long generations); finest near the usual
# SLOs (50 ms - 2 s), where histogram_quantile interpolates inside a bucket.
LATENCY_BUCKETS_S = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0),
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TICK_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

MG = ("model", "gpu")

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Spec:
    """One exported metric: its type, name (without ``PREFIX``), help text and labels."""

    kind: type  # Counter, Gauge, Histogram or Info
    name: str  # a counter's ends in _total (prometheus_client keeps it on the sample)
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms only

    def build(self, registry: CollectorRegistry) -> Any:
        extra = {"buckets": self.buckets} if self.buckets else {}
        return self.kind(f"{PREFIX}{self.name}", self.help, self.labels, registry=registry, **extra)


@dataclass(frozen=True)
class Reading:
    """A gauge series a tick sets from one field of a model's (or the card's, or an engine's) status."""

    metric: str  # Spec.name
    key: str  # the status field
    per: float = 1.0  # divisor: milliseconds in, seconds out
    labels: tuple[str, ...] = ()  # label values after model/gpu (a quantile, a state)
    default: Any = None  # when the field is absent
    unit: str | None = None  # set only for models whose batch unit is this; others have no series


# ---- from replica reports
REPORT_SPECS = (
    Spec(
        Counter,
        "requests_total",
        "Requests finished, by outcome (ok, rejected, timeout, shed: 504 too late for the SLO, error).",
        (*MG, "outcome"),
    ),
    Spec(Counter, "arrivals_total", "Requests admitted to a replica's queue.", MG),
    Spec(
        Histogram,
        "request_latency_seconds",
        "End-to-end latency of completed requests (the replicas' reported samples).",
        MG,
        LATENCY_BUCKETS_S,
    ),
    Spec(Histogram, "batch_size", "Requests per executed batch.", MG, BATCH_BUCKETS),
    Spec(Histogram, "batch_execution_seconds", "Model execution time per batch.", MG, LATENCY_BUCKETS_S),
    Spec(Counter, "busy_seconds_total", "Seconds the replicas spent executing batches.", MG),
    Spec(Counter, "oom_splits_total", "Batches split in two after an out-of-memory error.", MG),
    Spec(Counter, "emergency_shrinks_total", "Fast-loop halvings of the batch cap (memory emergency).", MG),
    Spec(Counter, "reports_total", "Stats reports received from replicas.", MG),
    Spec(Counter, "llm_prompt_tokens_total", "Prompt tokens the LLM engines admitted.", MG),
    Spec(Counter, "llm_generation_tokens_total", "Tokens the LLM engines generated.", MG),
    Spec(Counter, "llm_preemptions_total", "Sequences the LLM engines evicted from the KV cache and recomputed.", MG),
)
ENGINE_COUNTERS = (  # (counter, the engine report's count since the engine started)
    ("llm_prompt_tokens_total", "tokens_in"),
    ("llm_generation_tokens_total", "tokens_out"),
    ("llm_preemptions_total", "preemptions"),
)

# ---- from the status dict, each tick: one series per model
MODEL_SPECS = (
    Spec(Gauge, "quota_granted_bytes", "Memory quota granted to the model now.", MG),
    Spec(Gauge, "quota_base_bytes", "The model's guaranteed quota (config quota.base).", MG),
    Spec(Gauge, "quota_used_bytes", "Memory the model's replicas use now.", MG),
    Spec(Gauge, "max_batch_requests", "Batch cap of a model whose batch unit is requests.", MG),
    Spec(Gauge, "max_batch_tokens", "Batch cap of a model whose batch unit is tokens.", MG),
    Spec(Gauge, "batch_wait_timeout_seconds", "Serve batch wait timeout.", MG),
    Spec(Gauge, "queue_depth", "Requests waiting or running, summed over replicas.", MG),
    Spec(
        Gauge,
        "window_latency_seconds",
        "Latency quantiles over the broker's sliding window, as its policy reads them (NaN: no samples).",
        (*MG, "quantile"),
    ),
    Spec(
        Gauge,
        "latency_slo_seconds",
        "Latency cap in force for the quantile (slo_p95_ms x the profile's latency_slack).",
        (*MG, "quantile"),
    ),
    Spec(
        Gauge,
        "slo_attainment_ratio",
        "Share of requests in the window answered within the SLO, 0..1 (NaN: none).",
        MG,
    ),
    Spec(
        Gauge,
        "cost_per_1k_requests",
        "GPU cost per 1000 completed requests at the active profile's price (NaN: no completions).",
        MG,
    ),
    Spec(Gauge, "admit", "1 while the model admits requests, 0 while paused by an emergency.", MG),
    Spec(Gauge, "replicas", "Replicas that reported recently.", MG),
    Spec(Gauge, "settings_version", "Version of the model's settings.", MG),
)
MODEL_READINGS = (
    Reading("quota_granted_bytes", "grant_bytes"),
    Reading("quota_base_bytes", "base_bytes"),
    Reading("quota_used_bytes", "used_bytes"),
    Reading("max_batch_requests", "max_batch_size", unit="requests"),
    Reading("max_batch_tokens", "max_batch_size", unit="tokens"),
    Reading("batch_wait_timeout_seconds", "batch_wait_timeout_s"),
    Reading("queue_depth", "queue_depth"),
    *(Reading("window_latency_seconds", f"p{p}_ms", 1000.0, (q,)) for q, p in QUANTILES),
    Reading("latency_slo_seconds", "slo_p95_ms", 1000.0, ("0.95",)),
    Reading("slo_attainment_ratio", "attainment"),
    Reading("cost_per_1k_requests", "cost_per_1k_requests"),
    Reading("admit", "admit", default=True),
    Reading("replicas", "replicas"),
    Reading("settings_version", "settings_version"),
)

# ---- an LLM engine's status (gpubroker.broker.control.llm_window.engine_status), each tick
ENGINE_SPECS = (
    Spec(Gauge, "llm_ttft_seconds", "Time to first token over the engine's recent completions.", (*MG, "quantile")),
    Spec(Gauge, "llm_tpot_seconds", "Time per output token over the engine's recent completions.", (*MG, "quantile")),
    Spec(
        Gauge,
        "llm_slo_seconds",
        "TTFT and TPOT objectives for the quantile (llm.ttft_slo_ms, llm.tpot_slo_ms).",
        (*MG, "metric", "quantile"),
    ),
    Spec(Gauge, "llm_sequences", "Sequences running in the engine and waiting at its admission.", (*MG, "state")),
    Spec(Gauge, "llm_kv_blocks", "KV cache blocks used and free now.", (*MG, "state")),
    Spec(Gauge, "llm_max_num_seqs", "Bound the broker set: sequences the engine runs at once.", MG),
    Spec(Gauge, "llm_max_batched_tokens", "Bound the broker set: tokens the engine batches per step.", MG),
    Spec(Gauge, "llm_kv_blocks_limit", "Bound the broker set: KV cache blocks.", MG),
    Spec(Gauge, "llm_prefill_paused", "1 while the broker holds new prefills back, else 0.", MG),
)
ENGINE_READINGS = (
    *(Reading(f"llm_{m}_seconds", f"{m}_p{p}_ms", 1000.0, (q,)) for m in ("ttft", "tpot") for q, p in QUANTILES),
    *(Reading("llm_slo_seconds", f"{m}_slo_ms", 1000.0, (m, "0.95")) for m in ("ttft", "tpot")),
    *(Reading("llm_sequences", state, labels=(state,)) for state in ("running", "waiting")),
    *(Reading("llm_kv_blocks", f"kv_blocks_{state}", labels=(state,)) for state in ("used", "free")),
    Reading("llm_max_num_seqs", "max_num_seqs"),
    Reading("llm_max_batched_tokens", "max_batched_tokens"),
    Reading("llm_kv_blocks_limit", "kv_blocks"),
    Reading("llm_prefill_paused", "prefill_paused"),
)

# ---- the card, each tick
CARD_SPECS = (
    Spec(Gauge, "card_capacity_bytes", "Card memory (host memory pool on cpu).", ("gpu",)),
    Spec(Gauge, "card_usable_bytes", "What the ledger may grant: capacity less reserve and overhead.", ("gpu",)),
    Spec(Gauge, "card_used_bytes", "Memory used on the card by the models now.", ("gpu",)),
    Spec(Gauge, "card_granted_bytes", "Sum of the models' grants.", ("gpu",)),
    Spec(Gauge, "card_free_ratio", "Free share of the card now, 0..1 (NaN before the first tick).", ("gpu",)),
    Spec(Gauge, "price_per_gpu_hour", "Price per GPU-hour of the active profile.", ("gpu",)),
    Spec(Gauge, "dry_run", "1 when the broker decides but applies nothing.", ("gpu",)),
    Spec(Gauge, "active_profile", "1 for the active price profile, 0 for profiles active before.", ("gpu", "profile")),
)
CARD_READINGS = (
    Reading("card_capacity_bytes", "capacity_bytes"),
    Reading("card_usable_bytes", "usable_bytes"),
    Reading("card_used_bytes", "used_bytes"),
    Reading("card_granted_bytes", "granted_bytes"),
    Reading("card_free_ratio", "free_frac"),
    Reading("price_per_gpu_hour", "price_per_gpu_hour"),
    Reading("dry_run", "dry_run", default=False),
)

# ---- from the decision and the tick itself; config reloads
TICK_SPECS = (
    Spec(
        Counter,
        "decisions_total",
        "Settings changes, by the metric that triggered them (fixed set; else 'other').",
        (*MG, "trigger"),
    ),
    Spec(Counter, "quota_transfers_total", "Quota ledger steps, by kind.", ("gpu", "kind")),
    Spec(Counter, "quota_transferred_bytes_total", "Bytes moved by quota ledger steps, by kind.", ("gpu", "kind")),
    Spec(Counter, "ticks_total", "Slow-loop ticks run.", ("gpu",)),
    Spec(Histogram, "tick_duration_seconds", "Wall time of one slow-loop tick.", ("gpu",), TICK_BUCKETS_S),
    Spec(
        Histogram,
        "checkpoint_write_seconds",
        "Wall time of the broker's write after a tick: a many-card fleet's one checkpoint file "
        "for every card, and the decision journal.",
        (),
        TICK_BUCKETS_S,
    ),
    Spec(Info, "config", "Hash of the config the broker runs."),
    Spec(
        Gauge,
        "config_last_reload_success",
        "1 if the last config load (start-up or apply) succeeded, 0 if the last apply was refused.",
    ),
    Spec(Gauge, "config_last_reload_timestamp_seconds", "Epoch time of the last config load (start-up or apply)."),
    Spec(Counter, "config_reload_failures_total", "Refused applies."),
)

SPECS = REPORT_SPECS + MODEL_SPECS + ENGINE_SPECS + CARD_SPECS + TICK_SPECS


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


def _read(status: Mapping[str, Any], r: Reading) -> float | None:
    """The value ``r`` sets from ``status``; None: no series (another batch unit). Unknown stays the
    one ``math.nan`` (ticks compare the values they set)."""
    if r.unit is not None and status.get("batch_unit", "requests") != r.unit:
        return None
    v = _num(status.get(r.key, r.default))
    return v if r.per == 1.0 or v != v else v / r.per


class BrokerMetrics:
    """Every metric the broker exports, in one registry: ``self.m[name]`` is the metric
    ``gpubroker_<name>`` of ``SPECS``.

    ``registry=None`` uses prometheus_client's global ``REGISTRY`` (one instance per process);
    the broker passes its own ``CollectorRegistry()`` so a process may hold several brokers.
    ``gpu`` is the ``gpu`` label value (the config's device, e.g. ``cpu`` or ``cuda:0``).
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, gpu: str = "gpu0", clock: Callable[[], float] = time.time
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.m: dict[str, Any] = {spec.name: spec.build(self.registry) for spec in SPECS}
        self._clock = clock
        self._start_view(gpu)
        self.m["config_last_reload_success"].set(1)  # the broker only starts on a valid config
        self.m["config_last_reload_timestamp_seconds"].set(self._clock())

    def _start_view(self, gpu: str) -> None:
        """The per-card state of a view: its ``gpu`` label and what its ticks and reports set."""
        self.gpu = gpu
        self._models: set[str] = set()  # models with per-model gauge series
        self._series: dict[tuple[str, ...], Any] = {}  # (metric, labels) -> child: what ticks and reports set
        # model -> the gauge values its last tick set: the same values (most models, most ticks) skip the sets
        self._last: dict[str, tuple[float | None, ...]] = {}
        self._engine_seen: dict[tuple[str, str], tuple[int, ...]] = {}  # (model, replica) -> engine counts
        self._profile: str | None = None
        self._ticked = False

    def for_gpu(self, gpu: str) -> BrokerMetrics:
        """The same series under another ``gpu`` label: one view per card of a many-card fleet,
        all in this registry (``gpubroker.broker.fleet_core``)."""
        view = copy.copy(self)
        view._start_view(gpu)
        return view

    def _child(self, name: str, *labels: str) -> Any:
        """``self.m[name].labels(*labels)``, kept: a tick sets some 18 series a model and a report
        about 11, and ``labels`` takes a lock and builds a key each time. ``_forget_model`` drops a model's."""
        key = (name, *labels)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = self.m[name].labels(*labels)
        return child

    # ---------------------------------------------------------------- reports
    @_never_raises
    def observe_rejections(self, model: str, count: int) -> None:
        """Requests the ingress refused before a replica saw them (Serve queue full, replica gone)."""
        self._child("requests_total", model, self.gpu, "rejected").inc(count)

    @_never_raises
    def observe_report(self, report: StatsReport) -> None:
        """Fold one replica's stats delta into the counters and histograms."""
        lab = (report.model, self.gpu)
        child = self._child  # a model's series are kept between reports, as between ticks
        child("reports_total", *lab).inc()
        counts = (report.completions, report.rejections, report.timeouts - report.shed, report.shed, report.errors)
        for outcome, n in zip(OUTCOMES, counts):
            series = child("requests_total", *lab, outcome)  # created at 0 so rate() works from the start
            if n > 0:
                series.inc(n)
        child("arrivals_total", *lab).inc(max(0, report.arrivals))
        for name, samples, per in (
            ("request_latency_seconds", report.latency_ms, 1000.0),
            ("batch_size", report.batch_requests, 1.0),
            ("batch_execution_seconds", [ms for _cost, ms in report.batches], 1000.0),
        ):
            hist = child(name, *lab)
            for v in samples:
                hist.observe(v / per)
        child("busy_seconds_total", *lab).inc(max(0.0, report.busy_s))
        child("oom_splits_total", *lab).inc(max(0, report.oom_splits))
        child("emergency_shrinks_total", *lab).inc(max(0, report.emergency_shrinks))
        if report.engine is not None:
            self._observe_engine_counts(report.model, report.replica_id, report.engine)

    def _observe_engine_counts(self, model: str, replica_id: str, engine: EngineReport) -> None:
        """An engine reports counts since it started: the counters take what grew since the
        replica's last report (all of it from a replica not seen before or an engine restarted)."""
        now = tuple(int(getattr(engine, key) or 0) for _, key in ENGINE_COUNTERS)
        before = self._engine_seen.get((model, replica_id), (0,) * len(now))
        for (name, _), n, b in zip(ENGINE_COUNTERS, now, before):
            self._child(name, model, self.gpu).inc(n - b if n >= b else n)
        self._engine_seen[(model, replica_id)] = now

    # ---------------------------------------------------------------- ticks
    @_never_raises
    def observe_tick(self, decision: FleetDecision, status: Mapping[str, Any], tick_s: float) -> None:
        """Gauges from ``status`` (BrokerCore.status() shape), counters from ``decision``."""
        g = self.gpu
        if not self._ticked:  # every ledger step's series from the first tick: rate() reads 0, not nothing
            for kind in MOVE_KINDS:
                self.m["quota_transfers_total"].labels(g, kind)
                self.m["quota_transferred_bytes_total"].labels(g, kind)
            self._ticked = True
        models = status.get("models", {})
        for name, m in models.items():
            values = tuple(_read(m, r) for r in MODEL_READINGS)
            # a NaN is the one ``math.nan`` (``_read``): another would only cost sets not needed
            if self._last.get(name) != values:
                self._set(name, MODEL_READINGS, values)
                self._last[name] = values
            if m.get("engine") is not None:
                engine = m["engine"]
                self._set(name, ENGINE_READINGS, tuple(_read(engine, r) for r in ENGINE_READINGS))
        for gone in self._models - set(models):
            self._forget_model(gone)
        self._models = set(models)
        self._observe_card(decision, status)
        for name, md in decision.models.items():
            counter = self._child("decisions_total", name, g, _enum(md.trigger, TRIGGERS))
            if md.changed:
                counter.inc()
        for move in decision.moves:
            kind = _enum(move.kind, MOVE_KINDS)
            self.m["quota_transfers_total"].labels(g, kind).inc()
            self.m["quota_transferred_bytes_total"].labels(g, kind).inc(max(0, move.amount_bytes))
        self.m["ticks_total"].labels(g).inc()
        self.m["tick_duration_seconds"].labels(g).observe(max(0.0, tick_s))

    def _set(self, model: str, readings: tuple[Reading, ...], values: tuple[float | None, ...]) -> None:
        for r, v in zip(readings, values):
            if v is not None:
                self._child(r.metric, model, self.gpu, *r.labels).set(v)

    def _observe_card(self, decision: FleetDecision, status: Mapping[str, Any]) -> None:
        g = self.gpu
        for r in CARD_READINGS:
            self.m[r.metric].labels(g).set(_read(status, r))
        profile = str(status.get("profile") or decision.profile)
        if profile != self._profile:
            if self._profile is not None:
                self.m["active_profile"].labels(g, self._profile).set(0)
            self.m["active_profile"].labels(g, profile).set(1)
            self._profile = profile
        if status.get("config_hash"):
            self.m["config"].info({"config_hash": str(status["config_hash"])})

    def _forget_model(self, name: str) -> None:
        """Drop a model's gauge series once it is no longer in the config (counters keep their history)."""
        for r in MODEL_READINGS + ENGINE_READINGS:
            try:
                self.m[r.metric].remove(name, self.gpu, *r.labels)
            except KeyError:
                pass
        self._series = {k: v for k, v in self._series.items() if k[1] != name}
        self._last.pop(name, None)
        self._engine_seen = {k: v for k, v in self._engine_seen.items() if k[0] != name}

    @_never_raises
    def observe_checkpoint(self, write_s: float) -> None:
        """The fleet's write after a tick (``gpubroker.broker.fleet_store``); cards' ticks time their own step."""
        self.m["checkpoint_write_seconds"].observe(max(0.0, write_s))

    # ---------------------------------------------------------------- reloads
    @_never_raises
    def observe_reload(self, ok: bool, config_hash: str) -> None:
        """One ``apply``: success flag and time; on failure a counter; ``config_hash`` is the hash in force after it."""
        self.m["config_last_reload_success"].set(1 if ok else 0)
        self.m["config_last_reload_timestamp_seconds"].set(self._clock())
        if not ok:
            self.m["config_reload_failures_total"].inc()
        if config_hash:
            self.m["config"].info({"config_hash": str(config_hash)})

    # ---------------------------------------------------------------- helpers
    def sample_names(self) -> set[str]:
        """Every sample name the registry exports now (``_bucket``/``_sum``/``_count``/``_total``/``_info`` included)."""
        return {s.name for fam in self.registry.collect() for s in fam.samples}


# ---------------------------------------------------------------- the /metrics endpoint
class Exporter:
    """A running ``/metrics`` endpoint; ``close()`` stops it."""

    def __init__(self, server: Any, thread: Any, host: str, port: int) -> None:
        self.server, self.thread, self.host, self.port = server, thread, host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_exporter(metrics: Any, host: str = "127.0.0.1", port: int = 9464) -> Exporter | None:
    """Serve ``metrics.registry`` at ``http://host:port/metrics``; None when disabled (port 0) or not possible.

    A port already in use (another broker, or a second exporter in the same process) is logged
    as an error naming the port and the config field to change; the broker keeps running.
    """
    if not port:
        logger.info("metrics exporter disabled (broker.metrics_port is 0)")
        return None
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        logger.error(
            "metrics exporter could not bind %s:%d (%s); the broker runs without /metrics. "
            "Free the port or set broker.metrics_port to another port (0 disables the exporter).",
            host,
            port,
            exc.strerror or exc,
        )
        return None
    exporter = Exporter(server, thread, host, int(server.server_address[1]))
    logger.info("metrics exporter serving %s", exporter.url)
    return exporter


class NullMetrics:
    """Metrics that record nothing: for the simulator, whose thousands of virtual ticks a second
    need no Prometheus series (and no ``status()`` per tick to feed them)."""

    active = False

    def observe_report(self, report: StatsReport) -> None:
        pass

    def observe_rejections(self, model: str, count: int) -> None:
        pass

    def observe_tick(self, decision: FleetDecision, status: Mapping[str, Any], tick_s: float) -> None:
        pass

    def observe_reload(self, ok: bool, config_hash: str) -> None:
        pass

    def observe_checkpoint(self, write_s: float) -> None:
        pass
