"""The policy's own values: what a tick reads (``FleetSnapshot``) and what it returns (``FleetDecision``).

Frozen dataclasses, built by the report window (``gpubroker.broker.control.window``) and read by the rules;
they never cross the Ray boundary (the wire is ``gpubroker.broker.wire``). No ray, torch, pynvml or clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from gpubroker.broker.control.replica_rules import ReplicaChange
from gpubroker.broker.control.vocab import MoveKind, Rule, Trigger
from gpubroker.broker.wire import DecisionRecord, EngineBounds, EngineReport


@dataclass(frozen=True)
class GpuLoad:
    """The card (or the host-memory pool on cpu) as a whole."""

    capacity_bytes: int  # total memory
    usable_bytes: int  # capacity x (1 - reserve) - context overhead: what the ledger may grant
    used_bytes: int  # used now, all processes
    free_frac: float  # free share of capacity now
    sm_util_frac: float | None = None  # NVML SM utilisation, None without a GPU


@dataclass(frozen=True)
class ReplicaSeen:
    """One live replica's latest report, as the broker received it (for two-phase confirms)."""

    replica_id: str
    last_report_s: float  # broker time the latest report arrived
    settings_version: int  # settings version that report says the replica runs
    mem_used_bytes: int  # memory it measured in that report


@dataclass(frozen=True)
class ModelLoad:
    """One model's load over the sliding window, folded from its replicas' reports."""

    name: str
    replicas: int = 1  # replicas that reported in the window
    queue_depth: float = 0.0  # sum of the replicas' latest queue depths
    arrival_rate_rps: float = 0.0  # admitted requests per second over the rate window
    recent_arrival_rate_rps: float = 0.0  # the same over the last ~2 report intervals (a burst shows here first)
    completion_rate_rps: float = 0.0  # completions per second over the window
    reject_rate_rps: float = 0.0  # rejections + timeouts per second over the window
    p50_ms: float | None = None  # None when the window has no samples
    p95_ms: float | None = None
    p99_ms: float | None = None
    latency_samples: int = 0  # samples behind the percentiles
    recent_p95_ms: float | None = None  # P95 over the short rate window (what the AIMD reacts to)
    recent_samples: int = 0  # samples behind recent_p95_ms
    attainment: float | None = None  # share of requests in the window answered within the SLO (rejects/timeouts miss)
    batch_timings: tuple[tuple[float, float], ...] = ()  # recent (batch cost, exec ms) for the L(b) fit
    mean_batch: float = 0.0  # mean batch cost over the window
    max_batch: float = 0.0  # biggest batch cost over the window (the one behind mem_peak_bytes)
    cost_per_request: float = 1.0  # mean cost units per request (tokens per request for token models)
    busy_frac: float = 0.0  # share of wall time executing batches (per replica, averaged)
    mem_used_bytes: int = 0  # sum over replicas, latest
    mem_peak_bytes: int = 0  # max over the window
    emergency: bool = False  # a replica shrank in its fast loop since the last tick
    held_over: bool = False  # a replica refused requests since the last tick: it holds over its grant
    oom_splits: int = 0  # OOM splits since the last tick
    oom_costs: tuple[
        float, ...
    ] = ()  # costs of batches that ran out of memory, over the window (memory ceiling below the smallest)
    settings_version: int = 0  # lowest settings version the replicas report running
    weights_bytes: int = 0  # calibrated memory model: weights (0 = not calibrated yet)
    bytes_per_unit: float = 0.0  # calibrated memory model: bytes per batch unit (request or token)
    cost_unit: str = "requests"  # unit of batch cost: "requests" or "tokens"
    replica_reports: tuple[ReplicaSeen, ...] = ()  # every live replica's latest report (sorted by id)


LogLine = tuple[DecisionRecord, str]  # a decision-log entry (every key but the log's ``seq``) and its log line


@dataclass(frozen=True)
class EngineView:
    """One engine's latest report over the window, as the LLM kind's rules read it."""

    report: EngineReport  # the first live replica's latest engine report
    replicas: int  # live replicas reporting engine stats


@dataclass(frozen=True)
class FleetSnapshot:
    """Everything a policy may look at. ``now_s`` is epoch seconds (virtual in the simulator)."""

    now_s: float
    gpu: GpuLoad
    models: Mapping[str, ModelLoad] = field(default_factory=dict)
    engines: Mapping[str, EngineView] = field(default_factory=dict)  # kind: llm models with a live engine report


class ModelDecision(NamedTuple):
    """The broker's settings for one model after one tick, and why: every field a replica's
    ``ModelSettings`` carries (the core builds that wire object from these) and the reason.
    A named tuple: immutable, and a tick builds one per model."""

    max_batch_size: int  # new batch cap
    batch_wait_timeout_s: float  # new wait timeout
    grant_bytes: int  # memory grant after this tick's ledger moves
    admit: bool  # admission open?
    reason: str  # one line: trigger metric, its value, the rule, old -> new
    trigger: Trigger  # metric that drove the decision (a StrEnum: compares and serialises as its string)
    trigger_value: float  # its value
    changed: bool = False  # did batch cap, wait, grant, admit or a reclaim flag change?
    rule: Rule = Rule.HOLD  # the batch rule that answered (docs/RULES.md), or held by anti-oscillation
    version: int = 1  # settings version: rises with every change (a replica applies a new version)
    # the reclaim escalation (gpubroker.broker.control.lending.RECLAIM_STEPS) on the model as a borrower
    release_cache: bool = False  # step 1 reached: empty its caches
    drain: bool = False  # step 2 reached: pause admission and drain
    restart_token: int = 0  # bumped by step 3: its replicas restart
    engine: EngineBounds | None = None  # kind: llm: the engine bounds inside its grant
    replica_target: int = 1  # replicas it should run on this card (gpubroker.broker.control.replica_targets)


@dataclass(frozen=True)
class QuotaMove:
    """A ledger step taken this tick (for the decision log and metrics)."""

    kind: MoveKind  # lend, reclaim, confirm, grow, release, abort; reclaim escalation:
    # reclaim_cache, reclaim_drain, reclaim_restart (gpubroker.broker.control.lending.RECLAIM_STEPS)
    donor: str | None
    recipient: str | None
    amount_bytes: int
    reason: str


@dataclass(frozen=True)
class FleetDecision:
    now_s: float
    profile: str  # active price profile
    models: Mapping[str, ModelDecision]
    moves: tuple[QuotaMove, ...] = ()
    notes: tuple[str, ...] = ()  # e.g. "widened dead band for mlp after 5 reversals"
    log: tuple[LogLine, ...] = ()  # the kinds' own entries (engine bounds), logged before the settings
    replicas: tuple[ReplicaChange, ...] = ()  # replica targets that changed (each model's is in ``models``)
