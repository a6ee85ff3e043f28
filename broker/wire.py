"""What flows between replicas, the broker and the policies. Plain frozen dataclasses.

A replica sends a ``StatsReport`` (one delta per report interval) and gets ``ModelSettings``
back in the same round trip. The broker folds reports into a ``FleetSnapshot``; the policy
returns a ``FleetDecision``. Nothing here imports ray, torch, pynvml or reads the clock.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.control.vocab import EntryKind, MoveKind, Rule, Trigger  # noqa: F401 - the closed vocabularies, re-exported


@dataclass(frozen=True)
class StatsReport:
    """One replica's stats since its previous report (a delta, not a running total)."""

    model: str  # model (deployment) name from the config
    replica_id: str  # Serve replica id; unique per replica process
    seq: int  # report counter of this replica, from 0; a gap means a lost report
    now_s: float  # replica's wall clock (epoch seconds) when the report was built
    interval_s: float  # seconds this delta covers
    arrivals: int = 0  # requests admitted to the queue
    completions: int = 0  # requests answered OK
    rejections: int = 0  # requests refused (queue full, paused, too large)
    timeouts: int = 0  # requests that passed their deadline in the queue
    errors: int = 0  # requests that failed in the model
    latency_ms: tuple[float, ...] = ()  # end-to-end latency samples of completions (capped count)
    batches: tuple[tuple[float, float], ...] = ()  # (batch cost in the model's unit, execution ms) per batch
    batch_requests: tuple[int, ...] = ()  # requests per batch (same order as batches)
    busy_s: float = 0.0  # seconds spent executing batches in the interval
    queue_depth: int = 0  # requests waiting or running right now
    mem_used_bytes: int = 0  # replica process memory now (GPU memory on CUDA, RSS on cpu)
    mem_peak_bytes: int = 0  # peak over the interval
    device_free_frac: float | None = None  # free share of the card (or of the host quota on cpu)
    sm_util_frac: float | None = None  # NVML SM utilisation, None where there is no GPU
    oom_splits: int = 0  # batches split in two after an out-of-memory error
    emergency_shrinks: int = 0  # fast-loop halvings of the batch cap
    held_refusals: int = 0  # requests refused because the replica holds over its grant (deployments.enforce)
    shed: int = 0  # of the timeouts, those answered 504 at once: too late for the SLO (deployments.units.shed)
    settings_version: int = 0  # version of the settings the replica runs now
    card_id: str = ""  # the card the replica was placed on ("" in a one-card fleet)
    oom_costs: tuple[
        float, ...
    ] = ()  # cost of each batch that ran out of memory though its items then ran (deployments.units.oom)
    engine: dict[str, Any] | None = None  # kind: llm only: the engine's report (deployments.llm.server.engine_report)

    def to_dict(self) -> dict[str, Any]:
        """``asdict`` without its deep copy (tuples of numbers are immutable already)."""
        out = dict(self.__dict__)
        if self.engine is not None:
            out["engine"] = copy.deepcopy(self.engine)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StatsReport:
        data = dict(data)
        data["oom_costs"] = tuple(float(c) for c in data.get("oom_costs", ()))
        data["latency_ms"] = tuple(data.get("latency_ms", ()))
        data["batches"] = tuple(tuple(b) for b in data.get("batches", ()))
        data["batch_requests"] = tuple(data.get("batch_requests", ()))
        return cls(**data)


@dataclass(frozen=True)
class ModelSettings:
    """What a replica runs with; it applies a new one when ``version`` changes."""

    model: str
    version: int  # increases on every change the broker makes
    max_batch_size: int  # batch cap, in the model's batch unit (requests or tokens)
    batch_wait_timeout_s: float  # Serve batch wait timeout
    grant_bytes: int  # memory quota granted now (per model; replicas split it evenly)
    admit: bool = True  # False pauses admission (memory emergency)
    # A reclaim that the borrower does not honour escalates (broker.control.lending; the replica's
    # reaction is deployments.units.reclaim): release_cache -> drain -> restart_token bumps.
    release_cache: bool = False  # empty the allocator's caches (torch.cuda.empty_cache) and re-measure
    drain: bool = False  # pause admission and let the running batches finish
    restart_token: int = 0  # a replica restarts (fails check_health) when this passes the token it started with
    engine: dict[str, Any] | None = (
        None  # kind: llm only: the engine bounds the broker set (broker.control.llm_window.engine_settings)
    )

    def to_dict(self) -> dict[str, Any]:
        """``asdict`` without its deep copy of every field (every report's reply builds one)."""
        out = dict(self.__dict__)
        if self.engine is not None:
            out["engine"] = copy.deepcopy(self.engine)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSettings:
        """Known fields only: a checkpoint or a reply from an older broker may carry retired ones."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


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
    # the fit's sums over batch_timings (broker.control.latency_model.fit_sums), kept by the report window; None: sum them
    fit_sums: tuple[int, float, float, float, float] | None = None
    fit_max_cost: float | None = None  # the biggest cost in batch_timings, kept by the report window; None: look
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


@dataclass(frozen=True)
class FleetSnapshot:
    """Everything a policy may look at. ``now_s`` is epoch seconds (virtual in the simulator)."""

    now_s: float
    gpu: GpuLoad
    models: Mapping[str, ModelLoad] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelDecision:
    """The broker's settings for one model after one tick, and why."""

    max_batch_size: int  # new batch cap
    batch_wait_timeout_s: float  # new wait timeout
    grant_bytes: int  # memory grant after this tick's ledger moves
    admit: bool  # admission open?
    reason: str  # one line: trigger metric, its value, the rule, old -> new
    trigger: Trigger  # metric that drove the decision (a StrEnum: compares and serialises as its string)
    trigger_value: float  # its value
    changed: bool = False  # did batch cap, wait, grant or admit change?
    rule: Rule = Rule.HOLD  # the batch rule that answered (docs/RULES.md), or held by anti-oscillation


@dataclass(frozen=True)
class QuotaMove:
    """A ledger step taken this tick (for the decision log and metrics)."""

    kind: MoveKind  # lend, reclaim, confirm, grow, release, abort; reclaim escalation:
    # reclaim_cache, reclaim_drain, reclaim_restart (broker.control.lending.RECLAIM_STEPS)
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
