r"""The wire: what crosses the Ray boundary between replicas, the Serve side and the broker.

A replica sends a ``StatsReport`` (one delta per report interval; an LLM replica's carries its
engine's ``EngineReport``) and gets its ``ModelSettings`` back in the same round trip; the Serve
side pulls the ``ServePlan`` (replica targets and re-placement); ``BrokerApi`` names every broker method with these types as its parameters and
results. Plain data crosses Ray only at one conversion on each side: the actor
(``gpubroker.broker.actor.BrokerActor``) and the callers' client (``gpubroker.broker.client.BrokerClient``),
both with the ``to_dict``/``from_dict`` below. The replies that are plain data already (status,
decision records, the small results) are ``TypedDict``\ s and cross Ray as they are.

**Unknown fields are dropped and logged, in both directions.** A ``from_dict`` keeps the fields its
type has and drops the rest, logging each dropped name once per type (``gpubroker.wire``): a newer
replica's report reaches an older broker, and a newer broker's reply an older replica, while a
rolling upgrade runs. A field the type requires and the data lacks raises ``WireError`` naming it.
A ``TypedDict`` reply is read by its keys: a reader takes the keys it knows and ignores the others.
No ray, torch, pynvml or clock here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Protocol, TypedDict

logger = logging.getLogger("gpubroker.wire")

_DROPPED_SEEN: set[tuple[str, str]] = set()  # (type, field) already logged: once each, not per report


class WireError(ValueError):
    """Plain data that does not make the wire type it should (a required field missing)."""


def _known_fields(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``data`` that the dataclass ``cls`` has; every other one is dropped and logged
    (once per type and name). Raises ``WireError`` naming a required field that ``data`` lacks."""
    own = fields(cls)
    names = {f.name for f in own}
    for name in sorted(k for k in data if k not in names):
        if (cls.__name__, name) not in _DROPPED_SEEN:
            _DROPPED_SEEN.add((cls.__name__, name))
            logger.warning(
                "%s: unknown field %r dropped (a peer on a newer gpubroker sends it; upgrade this side to read it)",
                cls.__name__,
                name,
            )
    required = [f.name for f in own if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise WireError(
            f"{cls.__name__}: missing field(s) {', '.join(missing)}; the peer runs an older gpubroker "
            "than this wire needs: upgrade it"
        )
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class EngineReport:
    """A continuous-batching engine's stats in a report (``gpubroker.deployments.llm.server.engine_report``):
    the engine's counters and bounds, TTFT/TPOT percentiles of recent completions, its cache and
    ceilings; what the LLM kind's rules (``gpubroker.broker.control.llm_rules.load_from_report``,
    ``rule_config_for``), the engine window and the metrics read. It crosses Ray inside
    ``StatsReport`` as plain data (``to_dict``/``from_dict``, unknown fields dropped and logged). The
    fields without a default are those the rules cannot do without (the load and the cache's geometry
    and ceilings); the others default to "nothing counted yet"."""

    running: int  # sequences admitted to the engine and not finished
    waiting: int  # sequences held by the admission layer
    kv_blocks_total: int  # blocks in the KV cache now
    kv_blocks_reserved: int  # blocks the admission layer reserved
    kv_block_tokens: int  # tokens per block
    kv_block_bytes: int  # bytes per block (all layers, K and V)
    max_model_len: int  # the context length
    max_num_seqs_max: int  # the engine's ceilings from its options
    max_batched_tokens_max: int
    kv_cache_blocks_min: int
    kv_cache_blocks_max: int
    model: str = ""  # model name
    engine_running: int = 0  # sequences the engine's own scheduler runs
    engine_waiting: int = 0  # sequences the engine's own scheduler holds waiting
    max_num_seqs: int = 0  # bound in force
    max_batched_tokens: int = 0  # bound in force
    prefill_paused: bool = False  # squeeze in force
    kv_blocks_used: int = 0  # blocks holding KV entries now
    kv_blocks_target: int = 0  # cache size asked for (differs from total until the next rebuild)
    kv_blocks_free: int = 0  # total - used
    kv_usage_frac: float = 0.0  # the engine's KV cache usage, 0..1
    kv_cache_bytes: int = 0  # the cache in bytes
    preemptions: int | None = None  # sequences evicted and recomputed (cumulative; None: the engine does not say)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of them, found (cumulative)
    tokens_in: int = 0  # prompt tokens of admitted sequences (cumulative)
    tokens_out: int = 0  # generated tokens (cumulative)
    finished: int = 0  # sequences ended by stop or length (cumulative)
    cancelled: int = 0  # sequences cancelled (cumulative)
    failed: int = 0  # sequences the engine failed (cumulative)
    shed: int = 0  # sequences refused unstarted after waiting past max_queue_wait_ms (cumulative)
    rebuilds: int = 0  # KV cache resizes (engine restarts between drains)
    last_restart_s: float = 0.0  # the last resize's shutdown + start
    restart_s_total: float = 0.0  # every resize's shutdown + start, summed
    prefill_s: float = 0.0  # sequence-seconds from admission to first token
    decode_s: float = 0.0  # sequence-seconds from first to last token
    prefill_time_frac: float = 0.0  # prefill's share of the engine's time
    seq_tokens_mean: float = 0.0  # mean prompt + output tokens of recent completions
    seq_tokens: int | None = None  # what a sequence holds in the cache, rounded up (None: not known yet)
    samples: int = 0  # completions behind the percentiles
    ttft_p50_ms: float | None = None  # time to first token, percentiles of recent completions (None: no samples)
    ttft_p95_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None  # time per output token after the first
    tpot_p95_ms: float | None = None
    tpot_p99_ms: float | None = None
    step_tokens_per_block: float = (
        0.0  # max_batched_tokens per KV block as configured: a grown cache grows the step by it (0: not said)
    )
    idle_for_s: float = 0.0  # seconds since the engine last had work
    asleep: bool = False  # CUDA sleep mode level 1: the cache is freed
    weights_bytes: int = 0  # the engine's weights (added by the report loop, gpubroker.deployments.llm.report_loop)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the Ray boundary (every value is a number, a bool, a string or None)."""
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineReport:
        """From plain data; unknown fields dropped and logged (module note)."""
        return cls(**_known_fields(cls, data))


class EngineStatus(TypedDict, total=False):
    """A ``kind: llm`` model's ``engine`` in ``status()`` (``gpubroker.broker.control.llm_window.engine_status``):
    what its engine reports (None before its first report), the token rates, the SLOs, the bounds
    the engine runs and, once the rules decided, the bounds they set and why."""

    running: int | None
    waiting: int | None
    kv_blocks_total: int | None
    kv_blocks_used: int | None
    kv_blocks_free: int | None
    kv_blocks_reserved: int | None
    kv_cache_bytes: int | None
    preemptions: int | None
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p95_ms: float | None
    tpot_p99_ms: float | None
    samples: int | None
    tokens_in_per_s: float  # prompt tokens per second over the window, live replicas summed
    tokens_out_per_s: float  # generated tokens per second, likewise
    ttft_slo_ms: float
    tpot_slo_ms: float
    reporting: bool  # a live replica reports engine stats
    running_bounds: dict[
        str, int | bool | None
    ]  # max_num_seqs, max_batched_tokens, prefill_paused as the engine runs them
    max_num_seqs: int  # the bounds the rules set (absent before their first decision)
    max_batched_tokens: int
    kv_blocks: int
    prefill_paused: bool
    rule: str  # the rule that answered last
    reason: str
    want_grant_bytes: int
    kv_cache_target_bytes: int


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
    held_refusals: int = (
        0  # requests refused because the replica holds over its grant (gpubroker.deployments.enforce.limits)
    )
    shed: int = (
        0  # of the timeouts, those answered 504 at once: too late for the SLO (gpubroker.deployments.replica.shed)
    )
    settings_version: int = 0  # version of the settings the replica runs now
    card_id: str = ""  # the card the replica was placed on ("" in a one-card fleet)
    oom_costs: tuple[
        float, ...
    ] = ()  # cost of each batch that ran out of memory though its items then ran (gpubroker.deployments.replica.oom)
    engine: EngineReport | None = (
        None  # kind: llm only: the engine's report (gpubroker.deployments.llm.server.engine_report)
    )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the Ray boundary: ``asdict`` without its deep copy (tuples of numbers are
        immutable already; the engine report as its own plain data)."""
        out = dict(self.__dict__)
        if self.engine is not None:
            out["engine"] = self.engine.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StatsReport:
        """From plain data; unknown fields dropped and logged (module note)."""
        known = _known_fields(cls, data)
        known["oom_costs"] = tuple(float(c) for c in known.get("oom_costs", ()))
        known["latency_ms"] = tuple(known.get("latency_ms", ()))
        known["batches"] = tuple((b[0], b[1]) for b in known.get("batches", ()))
        known["batch_requests"] = tuple(known.get("batch_requests", ()))
        if isinstance(known.get("engine"), Mapping):
            known["engine"] = EngineReport.from_dict(known["engine"])
        return cls(**known)


@dataclass(frozen=True)
class EngineBounds:
    """What the broker sets on a continuous-batching engine (``kind: llm``), inside its grant."""

    max_num_seqs: int  # sequences the engine runs at once
    max_batched_tokens: int  # tokens per engine step
    kv_blocks: int  # KV-cache blocks (the cache is resized at the engine's next drain on CPU)
    prefill_paused: bool  # no new prefills (memory emergency)
    kv_cache_bytes: int  # the KV cache those blocks hold


@dataclass(frozen=True)
class ModelSettings:
    """What a replica runs with; it applies a new one when ``version`` changes."""

    model: str
    version: int  # increases on every change the broker makes
    max_batch_size: int  # batch cap, in the model's batch unit (requests or tokens)
    batch_wait_timeout_s: float  # Serve batch wait timeout
    grant_bytes: int  # memory quota granted now (per model; replicas split it evenly)
    admit: bool = True  # False pauses admission (memory emergency)
    # A reclaim that the borrower does not honour escalates (gpubroker.broker.control.lending; the replica's
    # reaction is gpubroker.deployments.replica.reclaim): release_cache -> drain -> restart_token bumps.
    release_cache: bool = False  # empty the allocator's caches (torch.cuda.empty_cache) and re-measure
    drain: bool = False  # pause admission and let the running batches finish
    restart_token: int = 0  # a replica restarts (fails check_health) when this passes the token it started with
    engine: EngineBounds | None = (
        None  # kind: llm only: the engine bounds (gpubroker.broker.control.llm_window.engine_settings)
    )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the Ray boundary and the checkpoint."""
        out = dict(self.__dict__)
        if self.engine is not None:
            out["engine"] = dict(self.engine.__dict__)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSettings:
        """From plain data (a reply, a checkpoint); unknown fields, a retired one or a newer
        broker's, dropped and logged (module note)."""
        known = _known_fields(cls, data)
        if isinstance(known.get("engine"), Mapping):
            known["engine"] = EngineBounds(**_known_fields(EngineBounds, known["engine"]))
        return cls(**known)


@dataclass(frozen=True)
class ReplicaTarget:
    """How many replicas a model should run on one live card (``gpubroker.broker.control.replica_rules``)."""

    model: str
    card_id: str
    replicas: int


@dataclass(frozen=True)
class ServePlan:
    """What the Serve side must change, as the broker wants it now: the card groups to deploy
    (``gpubroker.deployments.serve.reconcile``) and the replica targets to scale to
    (``gpubroker.deployments.serve.scaler``). The broker publishes it (``BrokerApi.plan``) and never calls
    Serve; the fleet API's follower (``gpubroker.deployments.serve.follow``) pulls it and applies it. A
    replica's settings are not in it: each replica pulls its own in its report reply."""

    version: int  # placement version: +1 per re-placement (a card lost, or one joined)
    groups: Mapping[str, Mapping[str, int]]  # model -> card id -> replicas placed there now
    unplaced: Mapping[str, str]  # model -> why some of its replicas fit on no live card
    replica_targets: tuple[ReplicaTarget, ...]  # one per model per live card
    replacing: bool  # re-placement is on: a card loss re-places (a follower asked for it)
    dry_run: bool  # broker.dry_run: decide and log, apply nothing

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the Ray boundary."""
        return {
            "version": self.version,
            "groups": {m: dict(g) for m, g in self.groups.items()},
            "unplaced": dict(self.unplaced),
            "replica_targets": [dict(t.__dict__) for t in self.replica_targets],
            "replacing": self.replacing,
            "dry_run": self.dry_run,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServePlan:
        """From plain data; unknown fields (the plan's and its targets') dropped and logged (module note)."""
        known = _known_fields(cls, data)
        return cls(
            version=int(known["version"]),
            groups={m: {c: int(n) for c, n in g.items()} for m, g in known["groups"].items()},
            unplaced={m: str(why) for m, why in known["unplaced"].items()},
            replica_targets=tuple(ReplicaTarget(**_known_fields(ReplicaTarget, t)) for t in known["replica_targets"]),
            replacing=bool(known["replacing"]),
            dry_run=bool(known["dry_run"]),
        )


class ModelStatus(TypedDict, total=False):
    """One model in ``status()`` (a card's core; the fleet sums counts over the model's cards)."""

    grant_bytes: int
    base_bytes: int
    used_bytes: int
    max_batch_size: int
    batch_wait_timeout_s: float
    batch_unit: str
    queue_depth: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    slo_p95_ms: float  # the cap in force: slo_p95_ms x the profile's latency slack
    attainment: float | None  # share answered within the cap over the window (gpubroker.broker.control.attainment)
    completions: int
    misses: int
    arrival_rate_rps: float
    completion_rate_rps: float
    settings_version: int
    replicas: int  # replicas that reported lately
    enforcement: str  # the memory layers its live replicas registered (docs/ENFORCEMENT.md)
    admit: bool
    cost_per_1k_requests: float | None  # gpubroker.broker.control.cost
    cost_unit: str
    calibrated: bool
    emergency_shrinks: int
    oom_splits: int
    memory_ceiling: int | None  # the batch the grant holds (gpubroker.broker.control.policy.memory_view)
    fixed_bytes: int | None
    kind: str  # "llm" for an engine, with its "engine" part
    engine: EngineStatus  # bounds as set, what the engine reports, its SLOs (gpubroker.broker.control.llm_window)
    cards: list[str]  # the cards the model runs on
    replica_target: int  # replicas the broker wants, all cards (gpubroker.broker.control.replica_rules)


class ReconcileView(TypedDict):
    """In ``status()``: what the plan follower applied last (``gpubroker.deployments.serve.follow``)."""

    applied_version: int  # the plan version Serve runs
    last: Replaced | None  # what that re-placement changed
    error: str | None  # why the latest one failed (None: it did not)
    last_s: float | None  # when the latest one was applied
    enabled: bool  # re-placement is on


class BrokerStatus(TypedDict, total=False):
    """``status()``: one card's core, or the fleet (``gpubroker.broker.fleet_core`` adds ``cards``,
    ``placement_version`` and ``unplaced``; the actor adds its process and reconcile fields)."""

    config_hash: str
    launch_hash: str
    profile: str
    price_per_gpu_hour: float
    dry_run: bool
    device: str
    now_s: float
    capacity_bytes: int
    usable_bytes: int
    granted_bytes: int
    used_bytes: int
    free_frac: float | None
    ticks: int
    last_tick_s: float | None
    restored: bool
    checkpoint_path: str | None
    decision_seq: int
    models: dict[str, ModelStatus]
    cards: list[dict[str, Any]]  # per card: capacity, usable, granted, used, live, its models
    placement_version: int
    unplaced: dict[str, dict[str, Any]]  # model -> {"replicas", "reason"}
    pid: int
    started_s: float
    last_error: str | None
    reconcile: ReconcileView  # what the plan follower applied last (gpubroker.deployments.serve.follow)
    metrics_url: str | None


class DecisionRecord(TypedDict, total=False):
    """One decision-log entry (``decisions()``). Every entry has ``seq``, ``kind``
    (``gpubroker.broker.control.vocab.EntryKind``), ``time_s``, ``model`` and ``reason``; the other keys
    belong to some kinds: settings, replicas and engine changes say what moved and why
    (``trigger``, ``rule``, ``old``, ``new``), quota moves their two ends, placements the cards."""

    seq: int  # fleet-wide order
    kind: str
    time_s: float
    model: str | None
    reason: str
    card: str  # the card whose core logged it (a fleet of several cards)
    dry_run: bool
    trigger: str  # the metric that drove it (gpubroker.broker.control.vocab.Trigger)
    trigger_value: float | None
    rule: str  # the rule that answered (docs/RULES.md)
    inputs: dict[str, Any]  # what the rule read
    old: dict[str, Any] | None  # the settings (or target, or bounds) before (None: an engine's first bounds)
    new: dict[str, Any] | None  # and after
    move: str  # kind: move: lend, reclaim, confirm, grow, ... (gpubroker.broker.control.vocab.MoveKind)
    donor: str | None
    recipient: str | None
    amount_bytes: int
    cards: dict[str, int]  # kind: placement: card -> replicas placed there now
    unplaced: int  # kind: placement: replicas that fit on no live card
    want_grant_bytes: int  # kind: engine
    kv_cache_bytes: int  # kind: engine


class TickResult(TypedDict, total=False):
    """What one control step did (``tick``): a card's core answers the first five keys, the
    fleet adds ``cards`` (card id -> its core's result) and ``replicas_changed``."""

    ok: bool
    now_s: float  # the broker's clock at the tick
    changed: list[str]  # models whose settings changed (all cards)
    profile: str | None  # the price profile in force
    dry_run: bool | None
    cards: dict[str, TickResult]
    replicas_changed: list[str]  # models whose replica target changed


class Calibration(TypedDict, total=False):
    """What a replica measured at start-up, sent with ``register`` (``gpubroker.deployments.replica.calibration``)."""

    weights_bytes: int  # memory of the loaded model before any batch
    bytes_per_unit: float  # memory per unit of batch cost (request or token)
    bytes_per_item: float  # the same, by its older name
    parameter_bytes: int  # the weights as the parameters count them
    cost_unit: str  # the model's batch unit ("request", "token", ...)
    enforcement: str  # the memory layers the replica registered (docs/ENFORCEMENT.md)
    points: list[list[float]]  # measured (batch cost, bytes) points
    seconds: float  # wall time calibration took


class Ping(TypedDict):
    """``ping``: the broker answers, and which one."""

    ok: bool
    pid: int
    started_s: float
    config_hash: str


class RejectionsCounted(TypedDict):
    """``report_rejections``: what the broker counted, model -> requests."""

    counted: dict[str, int]


class PlacementFollowed(TypedDict):
    """``follow_placement``: re-placement is on, at this placement version."""

    ok: bool
    version: int


class CardsChanged(TypedDict):
    """``observe_cards``: True when the live cards moved (a loss or a join re-placed the fleet)."""

    changed: bool


class CardHealth(TypedDict):
    """``card_health``: the cards a router avoids (``gpubroker.deployments.serve.http_cards``)."""

    lost: list[str]  # cards marked lost
    silent: list[str]  # live cards whose replicas stopped reporting


class Replaced(TypedDict):
    """What the follower applied of a plan (``gpubroker.deployments.serve.reconcile.ReconcileResult``),
    sent back with ``plan_applied`` and shown in status."""

    redeployed: list[str]  # models whose apps were deployed again
    unplaced: list[str]  # of those, models with no replica placed
    groups: dict[str, dict[str, int]]  # model -> card -> replicas, for the redeployed models
    kept: dict[str, list[str]]  # model -> deployments kept exactly as deployed


class ApplyResult(TypedDict, total=False):
    """``apply``: the new config in force (``ok``) or refused (``issues`` say why and the fix)."""

    ok: bool
    config_hash: str  # the config in force after the call
    issues: list[str]
    notes: list[str]  # what the change did (or that nothing changed)


class CardCheckpoint(TypedDict, total=False):
    """``checkpoint_now``, per card: where the state was saved (``ok`` False: no checkpoint path)."""

    ok: bool
    path: str | None
    saved_at_s: float


class BrokerApi(Protocol):
    """Every method of the broker that replicas, the CLI and the Serve side call, with the wire
    types as parameters and results. Callers hold a ``gpubroker.broker.client.BrokerClient`` (which
    offers this protocol over an actor handle); the actor (``gpubroker.broker.actor.BrokerActor``) takes
    the same methods as plain data and converts at its side."""

    async def ping(self) -> Ping: ...

    # replicas (gpubroker.deployments.replica.broker_link)
    async def register(
        self, model: str, replica_id: str, calibration: Calibration | None = None, card_id: str = ""
    ) -> ModelSettings: ...

    async def report(self, report: StatsReport) -> ModelSettings: ...

    # the Serve side (gpubroker.deployments.serve.ingress, gpubroker.deployments.serve.follow)
    async def report_rejections(self, counts: Mapping[str, int]) -> RejectionsCounted: ...

    async def plan(self) -> ServePlan: ...

    async def follow_placement(self) -> PlacementFollowed: ...  # re-placement on

    async def observe_cards(self, alive: list[str]) -> CardsChanged: ...  # cards on live nodes

    async def plan_applied(self, version: int, result: Replaced | None, error: str | None) -> None: ...

    async def card_health(self) -> CardHealth: ...

    # the CLI and the HTTP API (gpubroker.cli, gpubroker.deployments.serve.ingress)
    async def status(self) -> BrokerStatus: ...

    async def decisions(self, model: str | None = None, since_seq: int = 0) -> list[DecisionRecord]: ...

    async def apply(self, config_text: str) -> ApplyResult: ...

    async def tick(self) -> TickResult: ...

    async def checkpoint_now(self) -> dict[str, CardCheckpoint]: ...  # card id -> where its state went

    async def config_text(self) -> str: ...

    async def settings(self, model: str, card_id: str = "") -> ModelSettings: ...
