"""Fleet config: the YAML an operator edits, validated by pydantic v2.

Every field has a description and constrained type; unknown keys are refused
(``extra="forbid"``). Cross-field rules (min <= base <= max, floor <= ceiling, the sum of
base quotas within usable capacity, windows that parse and do not overlap, exactly one
default profile) live in validators here, so a bad file is refused before anything runs.

``load_config`` / ``parse_config`` turn any failure into ``ConfigError`` whose ``issues``
each name the field path, the bad value and the fix.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gpubroker.quotas.cards import GpusSection, PlacementSpec
from gpubroker.quotas.config_errors import MISSING, ConfigIssue, duplicate_keys, issue_from_pydantic
from gpubroker.quotas.config_errors import ConfigError as ConfigError  # re-exported: the config's error
from gpubroker.quotas.llm_spec import LLM_ENGINES, LlmSpec, check_engine_keys, is_llm_model_ref
from gpubroker.quotas.placement import check_fleet_cards
from gpubroker.quotas.schedule import ProfilesSection
from gpubroker.quotas.sizes import UNITS_REQUIRED, ExactSize, Size, format_size
from gpubroker.quotas.vocab import BatchFormation, Strategy

BUILTIN_MODELS = ("minilm", "mlp", "cnn", "profiled")
DEFAULT_CUDA_CONTEXT_BYTES = 512 * 1024**2
DIRECT_INGRESS_PORTS = (30000, 31000)  # Serve's direct ingress: a replica's own port in this range
EMULATED_FIGURES = ("a_ms", "c_ms", "token_ms", "weights_bytes", "bytes_per_item", "unit")  # profiled's options


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class BrokerSection(_Strict):
    name: str = Field("gpubroker", description="Name of the broker's detached Ray actor.")
    namespace: str = Field("gpubroker", description="Ray namespace the broker actor lives in.")
    control_interval_s: float = Field(
        1.0, gt=0, le=600, description="Slow loop period: seconds between broker decisions."
    )
    report_interval_s: float = Field(
        0.5, gt=0, le=60, description="Seconds between a replica's stats reports to the broker."
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Address the Prometheus exporter binds. Keep 127.0.0.1 unless a scraper runs elsewhere.",
    )
    metrics_port: int = Field(9464, ge=0, le=65535, description="Prometheus exporter port; 0 disables the exporter.")
    http_host: str = Field("127.0.0.1", description="Address Ray Serve's HTTP proxy binds.")
    http_port: int = Field(8000, ge=1, le=65535, description="Port of Ray Serve's HTTP proxy.")
    proxy_timeout_s: float | None | Literal["auto"] = Field(
        "auto",
        description="End-to-end limit Ray Serve's HTTP proxy gives a request (its HTTPOptions.request_timeout_s): "
        "a request with no answer by then (the replica holding it died and Serve's router lost it) gets a 408 "
        "instead of hanging until the client gives up. auto (default): the longest request_timeout_s of the "
        "fleet's models plus 90 s (120 s with the defaults), and no limit in a fleet with an LLM (a stream may run "
        "for minutes); a number of seconds; null: no limit. Applied when Serve starts (gpubroker up).",
    )

    @field_validator("proxy_timeout_s")
    @classmethod
    def _positive_timeout(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, (int, float)) and v <= 0:
            raise ValueError("must be above 0 seconds, null (no limit) or auto")
        return v

    direct_ingress: bool = Field(
        False,
        description="Each batch model's replica also answers HTTP on its own port (Ray Serve's direct ingress, "
        "ports 30000-31000 on http_host): one hop with no proxy, about a sixth of the serving path's CPU per "
        "request. GET /v1/models lists the URLs. Needs Ray started with RAY_SERVE_ENABLE_DIRECT_INGRESS=1 "
        "(gpubroker up does it for the local Ray it starts).",
    )
    dry_run: bool = Field(False, description="Decide and log, but apply nothing to the deployments.")
    batch_formation: BatchFormation = Field(
        BatchFormation.LAZY,
        description="lazy (default): while a batch runs, replicas hold new requests at a gate and let up to one "
        "cap's worth into @serve.batch when it finishes, so batches size themselves to the load; eager: leave Ray "
        "2.60's @serve.batch as is (a batch closes a wait after its first request, busy or not) and let the "
        "broker set waits that fill the batches it plans.",
    )
    checkpoint_path: str | None = Field(
        None, description="File the broker checkpoints its ledger and state to; default: under the Ray session dir."
    )
    transfer_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Lends unconfirmed this long abort; reclaims and releases escalate a step."
    )
    decision_log_size: int = Field(
        2000, ge=10, le=1_000_000, description="How many decisions the broker keeps in memory."
    )

    @model_validator(mode="after")
    def _intervals(self) -> BrokerSection:
        if self.report_interval_s > self.control_interval_s:
            raise ValueError(
                f"broker.report_interval_s ({self.report_interval_s}) is longer than broker.control_interval_s "
                f"({self.control_interval_s}); lower report_interval_s so each decision sees fresh reports"
            )
        return self


class GpuSection(_Strict):
    device: str = Field("auto", description="auto (CUDA if present, else cpu), cpu, or cuda:N.")
    capacity: Literal["auto"] | Size = Field(
        "auto", description="Card memory: 'auto' (read from NVML/torch, or host memory on cpu) or a size such as 24GiB."
    )
    reserve_frac: float = Field(
        0.12, ge=0.0, lt=1.0, description="Share of capacity never granted (fragmentation, allocator slack)."
    )
    emergency_free_frac: float = Field(
        0.10, gt=0.0, lt=1.0, description="Fast loop: below this free share, halve the batch cap at once."
    )
    context_overhead: Literal["auto"] | Size = Field(
        "auto", description="Per-process CUDA context memory subtracted from usable; auto = 512MiB on CUDA, 0 on cpu."
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value in ("auto", "cpu") or re.fullmatch(r"cuda:\d+", value):
            return value
        raise ValueError(f"'{value}' is not a device; use auto, cpu or cuda:N (e.g. cuda:0)")

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.capacity == "auto" else int(self.capacity)

    def context_overhead_bytes(self, processes: int, on_cuda: bool) -> int:
        per = self.context_overhead
        if per == "auto":
            per = DEFAULT_CUDA_CONTEXT_BYTES if on_cuda else 0
        return int(per) * processes

    def usable_bytes(self, capacity_bytes: int, processes: int = 0, on_cuda: bool | None = None) -> int:
        """capacity x (1 - reserve_frac) - per-process context overhead, never below 0."""
        if on_cuda is None:
            on_cuda = self.device.startswith("cuda")
        usable = int(capacity_bytes * (1.0 - self.reserve_frac)) - self.context_overhead_bytes(processes, on_cuda)
        return max(0, usable)


class QuotaSpec(_Strict):
    min: Size = Field(description="Working set the model never goes under, even when it lends.")
    base: Size = Field(description="Guaranteed share: the owner can always reclaim it.")
    max: Size = Field(description="Most the model may borrow up to.")

    @model_validator(mode="after")
    def _order(self) -> QuotaSpec:
        if self.min > self.base:
            raise ValueError(
                f"min ({format_size(self.min)}) is above base ({format_size(self.base)}); lower min or raise base"
            )
        if self.base > self.max:
            raise ValueError(
                f"base ({format_size(self.base)}) is above max ({format_size(self.max)}); lower base or raise max"
            )
        return self


class BatchSpec(_Strict):
    unit: Literal["requests", "tokens"] = Field(
        "requests", description="What floor/ceiling count: requests, or tokens for token-priced models."
    )
    floor: int = Field(
        2, ge=1, description="Smallest batch cap the broker sets (batch 1 wastes the card's fixed cost)."
    )
    ceiling: int = Field(64, ge=1, description="Largest batch cap the broker sets, before the memory ceiling.")
    initial: int | None = Field(
        None, ge=1, description="Batch cap at start; default: the floor doubled, within [floor, ceiling]."
    )
    max_concurrent_batches: int = Field(
        1, ge=1, le=64, description="Batches a replica runs at once (Serve's max_concurrent_batches)."
    )

    @model_validator(mode="after")
    def _order(self) -> BatchSpec:
        if self.floor > self.ceiling:
            raise ValueError(f"floor ({self.floor}) is above ceiling ({self.ceiling}); lower floor or raise ceiling")
        if self.initial is not None and not (self.floor <= self.initial <= self.ceiling):
            raise ValueError(
                f"initial ({self.initial}) is outside [floor {self.floor}, ceiling {self.ceiling}]; pick a value in that range"
            )
        return self

    @property
    def initial_cap(self) -> int:
        return self.initial if self.initial is not None else min(self.ceiling, max(self.floor, 2 * self.floor))


class WaitSpec(_Strict):
    min_ms: float = Field(0.0, ge=0, le=10_000, description="Shortest batch wait timeout the broker sets.")
    max_ms: float = Field(50.0, ge=0, le=10_000, description="Longest batch wait timeout the broker sets.")
    initial_ms: float | None = Field(
        None, ge=0, description="Wait timeout at start; default 10 ms clamped into [min_ms, max_ms]."
    )

    @model_validator(mode="after")
    def _order(self) -> WaitSpec:
        if self.min_ms > self.max_ms:
            raise ValueError(f"min_ms ({self.min_ms}) is above max_ms ({self.max_ms}); lower min_ms or raise max_ms")
        if self.initial_ms is not None and not (self.min_ms <= self.initial_ms <= self.max_ms):
            raise ValueError(
                f"initial_ms ({self.initial_ms}) is outside [{self.min_ms}, {self.max_ms}]; pick a value in that range"
            )
        return self

    @property
    def initial_s(self) -> float:
        ms = self.initial_ms if self.initial_ms is not None else min(self.max_ms, max(self.min_ms, 10.0))
        return ms / 1000.0


class ControlSpec(_Strict):
    strategy: Strategy = Field(
        Strategy.HYBRID,
        description="hybrid (default) combines queue band, P95 AIMD and the model-based jump; static never moves.",
    )
    window_s: float = Field(30.0, gt=0, le=3600, description="Sliding window for P50/P95/P99 and rates.")
    target_queue: int = Field(10, ge=0, description="Queue depth the dead band is centred on.")
    band_low: int = Field(6, ge=0, description="Below this queue depth, scale the batch down.")
    band_high: int = Field(15, ge=0, description="Above this queue depth, scale the batch up in proportion.")
    aimd_step: int = Field(
        2, ge=1, le=16, description="Additive growth step when P95 is well under the cap and work waits."
    )
    aimd_backoff: float = Field(0.7, gt=0, lt=1, description="Multiplicative shrink when P95 nears the cap.")
    p95_near_frac: float = Field(0.9, gt=0, le=1, description="P95 above this share of the cap counts as near the cap.")
    p95_low_frac: float = Field(0.6, gt=0, le=1, description="P95 under this share of the cap counts as well below it.")
    sm_low_frac: float = Field(0.4, ge=0, le=1, description="SM utilisation under this with work waiting: grow.")
    sm_high_frac: float = Field(0.95, ge=0, le=1, description="SM utilisation over this with P95 rising: do not grow.")
    min_samples: int = Field(20, ge=1, description="Latency samples needed in the window before P95 drives decisions.")
    fit_window: int = Field(256, ge=8, le=100_000, description="Batch timings kept for the online L(b) = a + c*b fit.")
    idle_util_frac: float = Field(
        0.2, ge=0, le=1, description="A model below this utilisation for idle_hold_s is idle and lends."
    )
    idle_hold_s: float = Field(5.0, ge=0, description="How long a model must stay idle before it lends quota.")
    reclaim_hold_s: float = Field(
        2.0, ge=0, description="How long an owner's load must stay back before it reclaims (hysteresis)."
    )
    reversal_limit: int = Field(
        4, ge=1, description="Direction reversals within reversal_window_s that count as oscillation."
    )
    reversal_window_s: float = Field(30.0, gt=0, description="Window over which reversals are counted.")
    # Tuning constants (defaults are the values the rules were tuned with; docs/RULES.md).
    drain_rho: float = Field(0.6, gt=0, lt=1, description="Utilisation the model plan aims for while a backlog drains.")
    burst_factor: float = Field(
        1.3, ge=1, description="The last reports' arrival rate is used when it is this many times the window's."
    )
    band_scale_max: float = Field(4.0, ge=1, description="Most the anti-oscillation may widen the dead bands (factor).")
    hold_max_intervals: int = Field(8, ge=1, description="Longest anti-oscillation hold, in broker.control_interval_s.")
    emergency_recovery_intervals: int = Field(
        5, ge=0, description="After an emergency, grow only by aimd_step for this many control intervals."
    )
    max_pause_intervals: int = Field(
        3, ge=1, description="An emergency admission pause re-opens after this many control intervals."
    )
    lend_regret_s: float = Field(
        30.0,
        gt=0,
        description="A loan its lender reclaims within this many seconds of lending doubles the lender's idle_hold_s (a later one halves it back).",
    )
    lend_backoff_max: float = Field(
        16.0, ge=1, le=1024, description="Most the lend-regret doubling may multiply idle_hold_s by."
    )
    working_set_margin: float = Field(
        1.1, ge=1, le=4, description="A lender keeps its peak memory times this (lending never cuts into it)."
    )
    recover_step_frac: float = Field(
        0.125,
        gt=0,
        le=1,
        description="Replica fast loop: widen the cap back by this share of the broker's cap per batch.",
    )
    critical_free_factor: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="Replica fast loop: pause admission below gpu.emergency_free_frac times this at the floor.",
    )

    @model_validator(mode="after")
    def _band(self) -> ControlSpec:
        if not (self.band_low <= self.target_queue <= self.band_high):
            raise ValueError(
                f"dead band [{self.band_low}, {self.band_high}] does not contain target_queue ({self.target_queue}); "
                "set band_low <= target_queue <= band_high"
            )
        if self.p95_low_frac >= self.p95_near_frac:
            raise ValueError(
                f"p95_low_frac ({self.p95_low_frac}) must be below p95_near_frac ({self.p95_near_frac}); lower p95_low_frac"
            )
        return self


class ModelProfile(_Strict):
    """A model's latency L(b) = a + c*b (+ token_ms per token) and memory weights + bytes_per_item*b."""

    a_ms: float = Field(ge=0, le=600_000, description="Fixed cost of one batch (launches, transfers), ms.")
    c_ms: float = Field(ge=0, le=600_000, description="Cost per batch unit (a request, or a token), ms.")
    token_ms: float = Field(0.0, ge=0, le=60_000, description="Extra cost per token whatever the unit, ms.")
    weights_bytes: ExactSize | None = Field(
        None, description="Memory held by the weights, e.g. 2GiB; default: half of quota.min."
    )
    bytes_per_item: ExactSize | None = Field(
        None,
        description="Memory per batch unit, e.g. 16MiB; default: what fills quota.base at batch.ceiling.",
    )
    unit: Literal["requests", "tokens"] | None = Field(
        None, description="What c_ms and bytes_per_item count: requests or tokens; default: batch.unit."
    )
    mean_tokens: float = Field(
        128.0, gt=0, description="Token models: mean request length when the arrivals carry none."
    )
    tokens_cv: float = Field(0.5, ge=0, le=10, description="Token models: CV of request lengths without a trace.")

    @model_validator(mode="after")
    def _some_cost(self) -> ModelProfile:
        if self.a_ms + self.c_ms + self.token_ms <= 0:
            raise ValueError("a_ms, c_ms and token_ms are all 0; give the batch some cost (e.g. a_ms: 5)")
        return self


class ModelSpec(_Strict):
    kind: Literal["batch", "llm"] = Field(
        "batch",
        description="batch: request batches under the batch rules; llm: a vLLM engine under the LLM rules (engine_kwargs: vLLM's arguments; options: the broker's bounds, docs/llm.md).",
    )
    llm: LlmSpec = Field(
        default_factory=LlmSpec,
        description="LLM objectives: expected peak concurrency, TTFT and TPOT SLOs (kind: llm).",
    )
    model: str = Field(
        description="Built-in model (minilm, mlp, cnn, profiled) or a user class as 'pkg.module:Class'; with kind: llm, "
        "tiny-llama, a local Hugging Face directory or a model id in the local Hugging Face cache (never downloaded)."
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the model class; with kind: llm, gpubroker's engine options "
        "(the broker's bounds: gpubroker.quotas.llm_spec.ENGINE_OPTIONS).",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        exclude_if=lambda value: not value,  # configs without them keep their hash
        description="kind: llm: vLLM's engine arguments under vLLM's own names (EngineArgs), passed through; "
        "max_num_seqs and max_num_batched_tokens are the largest the broker sets, num_gpu_blocks_override the "
        "cache at start.",
    )
    profile: ModelProfile | None = Field(
        None,
        exclude_if=lambda value: value is None,  # configs without one keep their hash
        description="Latency and memory figures of the model (gpubroker calibrate writes them): what simulate "
        "emulates and quota suggestions start from; a profiled model emulates them when it serves.",
    )
    quota: QuotaSpec = Field(description="Memory quota: min <= base <= max.")
    batch: BatchSpec = Field(default_factory=BatchSpec, description="Batch cap floor/ceiling and their unit.")
    wait: WaitSpec = Field(default_factory=WaitSpec, description="Batch wait timeout range.")
    slo_p95_ms: float = Field(100.0, gt=0, le=600_000, description="P95 latency cap in milliseconds.")
    priority: int = Field(0, ge=0, le=100, description="Higher priority borrows first when quota is short.")
    replicas: int = Field(1, ge=1, le=64, description="Serve replicas of this model on the card.")
    placement: PlacementSpec = Field(
        default_factory=PlacementSpec,
        description="Cards this model may run on (with gpus:): any, a list of card ids, a node label; spread replicas or not.",
    )
    max_queued: int = Field(
        256, ge=1, description="Requests waiting per replica before new ones get 503 (back-pressure)."
    )
    request_timeout_s: float = Field(
        30.0, gt=0, description="A request queued longer than this gets an explicit timeout."
    )
    shed_late: bool = Field(
        False,
        description="Answer 504 at once to a queued request that can no longer meet slo_p95_ms (its wait plus the replica's last batch time) instead of running it late (deployments/replica/shed.py); kind: batch only.",
    )
    max_body_bytes: Size = Field(  # type: ignore[assignment]  # the default is a size string, parsed like the YAML's
        "1MiB", description="Request bodies over this are refused with 413 before they reach the model."
    )
    control: ControlSpec = Field(
        default_factory=ControlSpec,
        description="Control loop parameters (docs/RULES.md: what each does, and its default).",
    )

    @property
    def max_ongoing_requests(self) -> int:
        """Serve's ``max_ongoing_requests`` per replica, fixed at deploy time: the largest batch
        (the ceiling) times ``max_concurrent_batches``, and room for the queue, so batches can
        fill at any cap the broker may set. The one owner of this number: the deployment and
        the simulator both read it here; the broker never sends it."""
        return (
            max(self.batch.ceiling * self.batch.max_concurrent_batches, self.max_queued)
            + self.batch.max_concurrent_batches
        )

    @model_validator(mode="before")
    @classmethod
    def _emulate_profile(cls, data: Any, info: ValidationInfo) -> Any:
        """A profiled model serves what its profile says: the profile's figures become the
        emulation's options (deployments/models/profiled.py), so the replica sleeps and allocates
        what the simulator emulates. In a file, options that say otherwise are refused."""
        if not (isinstance(data, dict) and data.get("model") == "profiled" and isinstance(data.get("profile"), dict)):
            return data
        options = dict(data.get("options") or {})
        try:
            profile = ModelProfile.model_validate(data["profile"])
        except ValidationError:
            return data  # the profile's own validation names what is wrong
        figures = {k: getattr(profile, k) for k in EMULATED_FIGURES if getattr(profile, k) is not None}
        differ = sorted(k for k, v in figures.items() if k in options and options[k] != v)
        if differ and info.context and info.context.get(UNITS_REQUIRED):
            key = differ[0]
            raise ValueError(
                f"options.{key}: {options[key]!r} differs from profile.{key} ({figures[key]!r}); a profiled "
                "model emulates its profile: remove it from options"
            )
        return {**data, "options": {**options, **figures}}

    @model_validator(mode="after")
    def _kind(self) -> ModelSpec:
        if self.kind == "llm" and (self.model in BUILTIN_MODELS or not is_llm_model_ref(self.model)):
            raise ValueError(
                f"model '{self.model}' is not an LLM; with kind: llm write model: {', '.join(LLM_ENGINES)}, a local "
                "Hugging Face directory or a model id in the local Hugging Face cache"
            )
        if self.kind == "llm":
            check_engine_keys(self.model, self.options, self.engine_kwargs)
        elif self.engine_kwargs:
            raise ValueError("engine_kwargs: vLLM's arguments, for kind: llm only; remove them or add kind: llm")
        if self.kind == "batch" and self.model in LLM_ENGINES:
            raise ValueError(f"model '{self.model}' is an LLM engine; add kind: llm")
        if self.kind == "llm" and self.shed_late:
            raise ValueError(
                "shed_late applies to request batches (kind: batch); an LLM engine admits sequences "
                "by its TTFT and TPOT objectives (llm:); remove shed_late"
            )
        return self

    @field_validator("model")
    @classmethod
    def _model_ref(cls, value: str, info: ValidationInfo) -> str:
        if value in BUILTIN_MODELS or value in LLM_ENGINES:
            return value
        if info.data.get("kind") == "llm" and is_llm_model_ref(value):
            return value  # a directory or a model id: gpubroker validate looks for it
        if re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_]\w*", value):
            return value
        raise ValueError(
            f"'{value}' is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor an import path; "
            "write a built-in name or 'pkg.module:Class'"
        )


class FleetConfig(_Strict):
    broker: BrokerSection = Field(default_factory=BrokerSection, description="Broker actor and its loops.")
    gpu: GpuSection = Field(default_factory=GpuSection, description="The card the models share.")
    gpus: GpusSection | None = Field(
        None,
        description="Cards of a Ray cluster: auto (discover every GPU) or a list of {id, node, index, capacity, device}; gpu then holds what they share (quotas/cards.py).",
    )
    models: dict[str, ModelSpec] = Field(description="Models on the card, by name.")
    profiles: ProfilesSection = Field(
        default_factory=ProfilesSection, description="Price-aware peak/off-peak profiles."
    )

    @field_validator("models")
    @classmethod
    def _names(cls, value: dict[str, ModelSpec]) -> dict[str, ModelSpec]:
        if not value:
            raise ValueError("no models; add at least one under models:")
        for name in value:
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", name):
                raise ValueError(
                    f"model name '{name}' is not allowed; use lower-case letters, digits, '-' or '_' (max 63 chars)"
                )
        return value

    @model_validator(mode="after")
    def _ports(self) -> FleetConfig:
        b = self.broker
        if b.metrics_port and b.metrics_port == b.http_port:
            raise ValueError(
                f"broker.metrics_port: {b.metrics_port} is also broker.http_port; the Prometheus exporter and "
                "Serve's HTTP proxy cannot share a port: pick another metrics_port (e.g. 9464), or 0 for no exporter"
            )
        low, high = DIRECT_INGRESS_PORTS
        for key, port in (("http_port", b.http_port), ("metrics_port", b.metrics_port)):
            if b.direct_ingress and low <= port <= high:
                raise ValueError(
                    f"broker.{key}: {port} is in {low}-{high}, the ports broker.direct_ingress gives replicas; "
                    f"pick a port outside that range"
                )
        return self

    @model_validator(mode="after")
    def _fits(self) -> FleetConfig:
        for name, spec in self.models.items():  # shedding runs at the lazy gate (deployments/replica/shed.py)
            if spec.shed_late and (spec.control.strategy == "static" or self.broker.batch_formation != "lazy"):
                raise ValueError(
                    f"models.{name}.shed_late: sheds at the replica's lazy gate, which this model does not "
                    f"run (control.strategy {spec.control.strategy}, broker.batch_formation "
                    f"{self.broker.batch_formation}); remove shed_late, or use batch_formation: lazy and a "
                    "strategy other than static"
                )
        if self.gpus is not None:  # many cards: every model placed, Σ base per card <= usable
            check_fleet_cards(self)
            return self
        capacity = self.gpu.capacity_bytes
        if capacity is None:
            return self
        usable = self.usable_bytes(capacity)
        total_base = sum(m.quota.base for m in self.models.values())
        if total_base > usable:
            raise ValueError(
                f"models.*.quota.base: sum of quota.base ({format_size(total_base)}) exceeds usable capacity ({format_size(usable)} = "
                f"{format_size(capacity)} x (1 - reserve_frac {self.gpu.reserve_frac}) - context overhead); "
                "lower some models' quota.base, lower gpu.reserve_frac, or raise gpu.capacity"
            )
        for name, spec in self.models.items():
            if spec.quota.min > usable:
                raise ValueError(
                    f"models.{name}.quota.min: {format_size(spec.quota.min)} exceeds usable capacity "
                    f"({format_size(usable)}); lower it or raise gpu.capacity"
                )
        return self

    @property
    def processes(self) -> int:
        return sum(m.replicas for m in self.models.values())

    def usable_bytes(self, capacity_bytes: int | None = None) -> int:
        capacity = capacity_bytes if capacity_bytes is not None else self.gpu.capacity_bytes
        if capacity is None:
            raise ValueError("gpu.capacity is 'auto' and no measured capacity was given")
        return self.gpu.usable_bytes(capacity, self.processes)

    def config_hash(self) -> str:
        """Stable short hash of the validated config (what `status` and metrics show)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# Loading, with errors that name the field, the bad value and the fix.


ConfigDoc = dict[str, object]
"""A fleet config as parsed YAML, or built in code to the same shape (``gpubroker.sim.loads.fleet_config``):
what the user wrote, any YAML value under its keys, before ``parse_config`` validates it into the typed
``FleetConfig``. Code past the parse reads ``FleetConfig``, never this."""


def parse_config(data: Any, source: str = "config", *, units_required: bool = False) -> FleetConfig:
    """Validate an already-parsed YAML document. ``units_required``: a size written as a bare
    number is an error (what a file an operator wrote gets; code may pass integer bytes)."""
    if not isinstance(data, dict):
        raise ConfigError(
            [ConfigIssue("", MISSING, "the file must be a mapping with broker/gpu/models/profiles sections")], source
        )
    try:
        return FleetConfig.model_validate(data, context={UNITS_REQUIRED: units_required})
    except ValidationError as exc:
        raise ConfigError([issue_from_pydantic(e, FleetConfig) for e in exc.errors()], source) from None


def parse_config_text(text: str, source: str = "config", *, units_required: bool = False) -> FleetConfig:
    """Validate YAML text; a key written twice in one mapping is an error naming both lines."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            [ConfigIssue("", MISSING, f"not valid YAML{where}: {getattr(exc, 'problem', exc)}; fix the syntax")],
            source,
            exit_code=2,
        ) from None
    if data is None:
        raise ConfigError(
            [ConfigIssue("", MISSING, "the file is empty; write a fleet config (see configs/demo.yaml)")],
            source,
            exit_code=2,
        )
    twice = duplicate_keys(text)
    if twice:
        raise ConfigError(twice, source)
    return parse_config(data, source, units_required=units_required)


def load_config(path: str | Path) -> FleetConfig:
    """Read and validate a config file, sizes with their units. Raises ConfigError (exit_code 2
    when unreadable or not YAML)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigIssue("", MISSING, f"cannot read {p}: {exc}")], str(p), exit_code=2) from None
    return parse_config_text(text, str(p), units_required=True)
