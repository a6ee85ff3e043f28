"""LLM engine rules: from one engine's load to its bounds and KV-cache size.

A continuous-batching engine batches every step, so the broker sets its bounds instead of a batch:
``max_num_seqs``, ``max_batched_tokens``, prefill admission, and the KV cache inside the grant. The
rules, first match wins: ``squeeze`` (low free memory: halve seqs, pause prefills), ``resume``,
``prefill_bound`` (TTFT over its SLO with TPOT within), ``recover``, ``idle_shrink`` (lend the
cache), ``busy_grow`` (only by ``grow_min_gain_frac``, and once the grant in flight to it lands: a
resize drains the engine; the step grows with the cache, ``step_tokens_for``), ``seqs_grow``,
``hold`` (docs/llm.md). ``start`` sets half the expected peak concurrency, capped by memory, and
keeps the engine's ``max_batched_tokens``; guard-rails are applied after the rule in one place
(``_clamp``). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

from gpubroker.broker.wire import EngineReport


class LlmRule(StrEnum):
    START = "start"  # first decision: half the expected peak, within memory
    SQUEEZE = "squeeze"  # free memory under 15%: halve max_num_seqs, pause prefills
    RESUME = "resume"  # headroom back: admit prefills again (or hold the pause in the hysteresis band)
    PREFILL_BOUND = "prefill_bound"  # TTFT over SLO, TPOT fine, prefill dominating: lower the bounds
    RECOVER = "recover"  # after a squeeze: step max_num_seqs back up
    IDLE_SHRINK = "idle_shrink"  # idle: shrink the KV cache to lend memory
    BUSY_GROW = "busy_grow"  # busy: grow the KV cache up to its max
    SEQS_GROW = "seqs_grow"  # waiting behind max_num_seqs with SLOs met: raise it
    HOLD = "hold"  # nothing to do


class LlmTrigger(StrEnum):
    EXPECTED_PEAK = "expected_peak_concurrency"
    FREE_MEM_FRAC = "free_mem_frac"
    TTFT_P95_MS = "ttft_p95_ms"
    IDLE_FOR_S = "idle_for_s"
    WAITING = "waiting"
    HOLD = "hold"


@dataclass(frozen=True)
class LlmRuleConfig:
    """One engine's rule parameters (from its model config and the engine's geometry)."""

    expected_peak_concurrency: int  # sequences in flight at the expected peak (config)
    ttft_slo_ms: float  # TTFT P95 objective
    tpot_slo_ms: float  # TPOT P95 objective
    kv_block_bytes: int  # bytes per KV block (all layers, K and V)
    kv_block_tokens: int  # tokens per KV block
    seq_tokens: int  # tokens one sequence reserves (prompt + max_tokens; the context length at worst)
    base_bytes: int = 0  # the model's footprint besides the KV cache (weights, step buffers)
    max_num_seqs_max: int = 64
    max_batched_tokens_min: int = 16
    max_batched_tokens_max: int = 512
    # the step's share of the cache as configured (max_batched_tokens / kv_cache_blocks at start): a
    # cache that grows grows the step by it, up to max_batched_tokens_max (0: the step stays)
    step_tokens_per_block: float = 0.0
    kv_blocks_min: int = 4
    kv_blocks_max: int = 256
    kv_spare_blocks: int = 2  # blocks the cache tensor holds besides the usable ones
    squeeze_free_frac: float = 0.15
    resume_free_frac: float = 0.25
    prefill_dominant_frac: float = 0.5  # prefill share of sequence time that counts as dominating
    min_samples: int = 8  # TTFT/TPOT samples before latency rules fire
    hold_s: float = 2.0  # seconds between non-safety changes (and between recovery steps)
    idle_hold_s: float = 5.0
    lend_floor_bytes: int = 0  # the model's quota min: an idle cache shrinks only to what this grant holds
    resize_hold_factor: float = 2.0  # idle at least this many times the last resize's seconds before a shrink
    busy_used_frac: float = 0.8  # cache reservations over this share count as busy
    seqs_backoff: float = 0.75
    seqs_step: int = 2  # smallest max_num_seqs raise; with a longer queue up to half of it (at most doubling)
    grow_min_gain_frac: float = 0.5  # a cache resize drains the engine: grow only by at least this share

    @property
    def blocks_per_seq(self) -> int:
        return max(1, math.ceil(self.seq_tokens / self.kv_block_tokens))


@dataclass(frozen=True)
class EngineLoad:
    """One engine's load, as the broker folds it from the replica's reports."""

    now_s: float
    running: int  # sequences in flight
    waiting: int  # sequences held by the admission layer
    ttft_p95_ms: float | None  # over the window; None without samples
    tpot_p95_ms: float | None
    samples: int  # completions behind the P95s
    prefill_time_frac: float  # share of sequence time before the first token (engine stats)
    kv_blocks_total: int  # cache size the engine runs now
    kv_blocks_reserved: int  # blocks reserved by running sequences
    free_mem_frac: float  # free share of the card (host memory quota on cpu)
    grant_bytes: int  # the model's grant now
    idle_for_s: float = 0.0  # how long nothing has run or waited (0 when busy)
    last_resize_s: float = 0.0  # what the engine's last cache resize cost (drain excluded; 0: none yet)
    incoming_bytes: int = 0  # grant on its way: transfers to it begun, not yet confirmed (a lend, a reclaim)
    max_batched_tokens: int = 0  # the engine's max_num_batched_tokens in force (0: not reported)


@dataclass(frozen=True)
class LlmState:
    """Between ticks: what the broker set last, and the squeeze's memory."""

    max_num_seqs: int
    max_batched_tokens: int
    kv_blocks: int  # target cache size
    prefill_paused: bool = False
    recover_to: int = 0  # max_num_seqs before the squeeze (0: nothing to recover)
    last_change_s: float = float("-inf")


@dataclass(frozen=True)
class LlmDecision:
    max_num_seqs: int
    max_batched_tokens: int
    kv_blocks: int
    prefill_paused: bool
    kv_cache_bytes: int  # bytes of the decided cache (usable + spare blocks)
    want_grant_bytes: int  # grant this engine would use: base + the largest cache it may grow to when busy
    rule: LlmRule
    trigger: LlmTrigger
    value: float  # the trigger metric's value
    reason: str  # names the trigger metric and its value, and what changed

    def bounds_changed(self, state: LlmState | None) -> bool:
        return state is None or (
            self.max_num_seqs,
            self.max_batched_tokens,
            self.kv_blocks,
            self.prefill_paused,
        ) != _settings(state)


@dataclass(frozen=True)
class _Want:
    state: LlmState  # proposed state before guard-rails
    trigger: LlmTrigger
    value: float
    reason: str


def kv_blocks_in_grant(cfg: LlmRuleConfig, grant_bytes: int) -> int:
    """Largest usable cache that fits in the grant after the base footprint, within kv_blocks_max."""
    room = (grant_bytes - cfg.base_bytes) // max(1, cfg.kv_block_bytes) - cfg.kv_spare_blocks
    return int(max(0, min(cfg.kv_blocks_max, room)))


def seqs_in_grant(cfg: LlmRuleConfig, grant_bytes: int) -> int:
    """Sequences whose reservations fit in the largest cache the grant allows (at least 1)."""
    return max(1, min(cfg.max_num_seqs_max, kv_blocks_in_grant(cfg, grant_bytes) // cfg.blocks_per_seq))


def cache_bytes(cfg: LlmRuleConfig, blocks: int) -> int:
    return (blocks + cfg.kv_spare_blocks) * cfg.kv_block_bytes


def _held(load: EngineLoad, cfg: LlmRuleConfig, s: LlmState) -> bool:
    return load.now_s - s.last_change_s < cfg.hold_s


def _squeeze(load: EngineLoad, cfg: LlmRuleConfig, s: LlmState) -> _Want | None:
    f = load.free_mem_frac
    if f >= cfg.squeeze_free_frac:
        return None
    if s.prefill_paused and (_held(load, cfg, s) or s.max_num_seqs <= 1):
        return _Want(
            s,
            LlmTrigger.FREE_MEM_FRAC,
            f,
            f"free_mem_frac {f:.3f} < {cfg.squeeze_free_frac}: prefills stay paused at max_num_seqs {s.max_num_seqs}",
        )
    new = max(1, s.max_num_seqs // 2)
    recover_to = max(s.recover_to, s.max_num_seqs)
    return _Want(
        replace(s, max_num_seqs=new, prefill_paused=True, recover_to=recover_to),
        LlmTrigger.FREE_MEM_FRAC,
        f,
        f"free_mem_frac {f:.3f} < {cfg.squeeze_free_frac}: halve max_num_seqs {s.max_num_seqs}->{new}, pause new prefills",
    )


def _resume(load: EngineLoad, cfg: LlmRuleConfig, s: LlmState) -> _Want | None:
    if not s.prefill_paused:
        return None
    f = load.free_mem_frac
    if f < cfg.resume_free_frac:
        return _Want(
            s,
            LlmTrigger.FREE_MEM_FRAC,
            f,
            f"free_mem_frac {f:.3f} < resume {cfg.resume_free_frac}: keep prefills paused",
        )
    return _Want(
        replace(s, prefill_paused=False),
        LlmTrigger.FREE_MEM_FRAC,
        f,
        f"free_mem_frac {f:.3f} >= {cfg.resume_free_frac}: resume prefills at max_num_seqs {s.max_num_seqs}",
    )


def _prefill_bound(load: EngineLoad, cfg: LlmRuleConfig, s: LlmState) -> _Want | None:
    ttft, tpot = load.ttft_p95_ms, load.tpot_p95_ms
    if load.samples < cfg.min_samples or ttft is None or ttft <= cfg.ttft_slo_ms:
        return None
    if tpot is not None and tpot > cfg.tpot_slo_ms:
        return None  # decode is slow too: not a prefill problem
    if load.prefill_time_frac < cfg.prefill_dominant_frac or _held(load, cfg, s):
        return None
    seqs = max(1, math.floor(s.max_num_seqs * cfg.seqs_backoff))
    tokens = max(cfg.max_batched_tokens_min, s.max_batched_tokens // 2)
    if (seqs, tokens) == (s.max_num_seqs, s.max_batched_tokens):
        return None
    tpot_txt = "n/a" if tpot is None else f"{tpot:.1f}"
    return _Want(
        replace(s, max_num_seqs=seqs, max_batched_tokens=tokens, recover_to=0),
        LlmTrigger.TTFT_P95_MS,
        ttft,
        f"ttft_p95_ms {ttft:.1f} > SLO {cfg.ttft_slo_ms:g} with tpot_p95_ms {tpot_txt} <= {cfg.tpot_slo_ms:g} "
        f"and prefill {load.prefill_time_frac:.2f} of sequence time: max_num_seqs {s.max_num_seqs}->{seqs}, "
        f"max_batched_tokens {s.max_batched_tokens}->{tokens}",
    )


def _recover(load: EngineLoad, cfg: LlmRuleConfig, s: LlmState) -> _Want | None:
    if s.recover_to <= s.max_num_seqs:
        return None
    f = load.free_mem_frac
    if f < cfg.resume_free_frac or _held(load, cfg, s):
        return _Want(
            s,
            LlmTrigger.FREE_MEM_FRAC,
            f,
            f"free_mem_frac {f:.3f}: hold max_num_seqs {s.max_num_seqs} (recovering to {s.recover_to})",
        )
    new = min(s.recover_to, s.max_num_seqs + cfg.seqs_step)
    left = 0 if new >= s.recover_to else s.recover_to
    return _Want(
        replace(s, max_num_seqs=new, recover_to=left),
        LlmTrigger.FREE_MEM_FRAC,
        f,
        f"free_mem_frac {f:.3f} >= {cfg.resume_free_frac}: step max_num_seqs {s.max_num_seqs}->{new} "
        f"toward {s.recover_to}",
    )


def lend_floor_blocks(cfg: LlmRuleConfig) -> int:
    """The smallest cache an idle engine keeps: what its quota min holds, never under the engine's minimum."""
    return max(cfg.kv_blocks_min, kv_blocks_in_grant(cfg, cfg.lend_floor_bytes))


def _idle_shrink(load: EngineLoad, cfg: LlmRuleConfig, s: LlmState) -> _Want | None:
    floor = lend_floor_blocks(cfg)
    hold = max(cfg.idle_hold_s, cfg.resize_hold_factor * load.last_resize_s)  # a shrink now, a regrow later
    if load.running or load.waiting or load.idle_for_s < hold or s.kv_blocks <= floor:
        return None
    lent = cache_bytes(cfg, s.kv_blocks) - cache_bytes(cfg, floor)
    return _Want(
        replace(s, kv_blocks=floor),
        LlmTrigger.IDLE_FOR_S,
        load.idle_for_s,
        f"idle_for_s {load.idle_for_s:.1f} >= {hold:g}: shrink KV cache {s.kv_blocks}->"
        f"{floor} blocks (frees {lent} bytes to lend; the quota min keeps {floor})",
    )


def cache_pressed(load: EngineLoad, cfg: LlmRuleConfig) -> bool:
    """The cache binds: what runs plus what waits would fill over ``busy_used_frac`` of it. A queue
    behind ``max_num_seqs`` alone is seqs_grow's; one request arriving at a quiet engine is neither
    (counted, it would regrow an engine that had just shrunk to lend, at every stray request)."""
    demand = load.kv_blocks_reserved + load.waiting * cfg.blocks_per_seq
    return demand >= cfg.busy_used_frac * max(1, load.kv_blocks_total)


def _busy_grow(load: EngineLoad, cfg: LlmRuleConfig, s: LlmState) -> _Want | None:
    cap = kv_blocks_in_grant(cfg, load.grant_bytes)
    if not cache_pressed(load, cfg) or s.kv_blocks >= cap or _held(load, cfg, s):
        return None
    soon = kv_blocks_in_grant(cfg, load.grant_bytes + load.incoming_bytes)
    if soon > cap:  # every resize drains the engine: grow once, when the grant in flight lands
        return _Want(
            s,
            LlmTrigger.WAITING,
            load.waiting,
            f"waiting {load.waiting} with {load.kv_blocks_reserved}/{load.kv_blocks_total} KV blocks reserved: "
            f"keep {s.kv_blocks} blocks until the {load.incoming_bytes} bytes in flight land (then {soon}; "
            f"the grant now allows {cap}), one resize instead of two",
        )
    new = cap  # straight to what the grant allows: every resize drains the engine once
    if new < s.kv_blocks * (1.0 + cfg.grow_min_gain_frac):
        return None  # not worth a drain: wait for more grant
    # the sequences waiting for blocks may run once the cache holds them: seqs_grow's 2-s steps
    # would take several of them to fill a cache grown mid-burst
    seqs = max(s.max_num_seqs, min(new // cfg.blocks_per_seq, s.max_num_seqs + load.waiting))
    tokens = step_tokens_for(cfg, new, s.max_batched_tokens)
    return _Want(
        replace(s, kv_blocks=new, max_num_seqs=seqs, max_batched_tokens=tokens),
        LlmTrigger.WAITING,
        load.waiting,
        f"waiting {load.waiting} with {load.kv_blocks_reserved}/{load.kv_blocks_total} KV blocks reserved: "
        f"grow KV cache {s.kv_blocks}->{new} blocks (grant allows {cap}), max_num_seqs {s.max_num_seqs}->{seqs}, "
        f"max_batched_tokens {s.max_batched_tokens}->{tokens}",
    )


def step_tokens_for(cfg: LlmRuleConfig, blocks: int, tokens_now: int) -> int:
    """The step a cache of ``blocks`` is fed by: the configured share of the cache, never below the
    step in force nor over the ceiling. A larger cache serves more with a larger step, a small one
    the same with any. The step changes only with the resize's restart, which the grow pays anyway."""
    if cfg.step_tokens_per_block <= 0:
        return tokens_now
    share = math.ceil(blocks * cfg.step_tokens_per_block)
    return max(tokens_now, min(cfg.max_batched_tokens_max, share))


def _seqs_grow(load: EngineLoad, cfg: LlmRuleConfig, s: LlmState) -> _Want | None:
    if load.waiting <= 0 or load.running < s.max_num_seqs or _held(load, cfg, s):
        return None
    if s.max_num_seqs >= seqs_in_grant(cfg, load.grant_bytes):
        return None
    ttft, tpot = load.ttft_p95_ms, load.tpot_p95_ms
    if load.samples >= cfg.min_samples and (
        (tpot is not None and tpot > cfg.tpot_slo_ms)
        or (ttft is not None and ttft > cfg.ttft_slo_ms and load.prefill_time_frac >= cfg.prefill_dominant_frac)
    ):
        return None
    new = s.max_num_seqs + max(cfg.seqs_step, min(load.waiting, s.max_num_seqs) // 2)
    return _Want(
        replace(s, max_num_seqs=new),
        LlmTrigger.WAITING,
        load.waiting,
        f"waiting {load.waiting} behind max_num_seqs {s.max_num_seqs} with SLOs met: raise it to {new}",
    )


def _hold(load: EngineLoad, cfg: LlmRuleConfig, s: LlmState) -> _Want | None:
    return _Want(
        s,
        LlmTrigger.HOLD,
        float(load.running),
        f"running {load.running}, waiting {load.waiting}: hold max_num_seqs {s.max_num_seqs}",
    )


RULES: tuple[tuple[LlmRule, Callable[[EngineLoad, LlmRuleConfig, LlmState], _Want | None]], ...] = (
    (LlmRule.SQUEEZE, _squeeze),
    (LlmRule.RESUME, _resume),
    (LlmRule.PREFILL_BOUND, _prefill_bound),
    (LlmRule.RECOVER, _recover),
    (LlmRule.IDLE_SHRINK, _idle_shrink),
    (LlmRule.BUSY_GROW, _busy_grow),
    (LlmRule.SEQS_GROW, _seqs_grow),
    (LlmRule.HOLD, _hold),
)


def start_state(cfg: LlmRuleConfig, grant_bytes: int) -> _Want:
    fits = seqs_in_grant(cfg, grant_bytes)
    half = max(1, math.ceil(0.5 * cfg.expected_peak_concurrency))
    seqs = min(half, fits)
    blocks = max(cfg.kv_blocks_min, cfg.expected_peak_concurrency * cfg.blocks_per_seq)
    state = LlmState(seqs, cfg.max_batched_tokens_max, blocks)
    return _Want(
        state,
        LlmTrigger.EXPECTED_PEAK,
        float(cfg.expected_peak_concurrency),
        f"expected_peak_concurrency {cfg.expected_peak_concurrency}: max_num_seqs {seqs} "
        f"(half the peak is {half}, memory allows {fits})",
    )


def _settings(s: LlmState) -> tuple[int, int, int, bool]:
    return s.max_num_seqs, s.max_batched_tokens, s.kv_blocks, s.prefill_paused


def _clamp(s: LlmState, cfg: LlmRuleConfig, grant_bytes: int) -> LlmState:
    kv_cap = max(cfg.kv_blocks_min, kv_blocks_in_grant(cfg, grant_bytes))
    return replace(
        s,
        max_num_seqs=max(1, min(s.max_num_seqs, seqs_in_grant(cfg, grant_bytes))),
        max_batched_tokens=max(cfg.max_batched_tokens_min, min(s.max_batched_tokens, cfg.max_batched_tokens_max)),
        kv_blocks=max(cfg.kv_blocks_min, min(s.kv_blocks, kv_cap)),
    )


def decide_llm(load: EngineLoad, cfg: LlmRuleConfig, state: LlmState | None) -> tuple[LlmDecision, LlmState]:
    """The first matching rule's bounds and cache size, after guard-rails, and the new state."""
    if state is None:
        rule, want = LlmRule.START, start_state(cfg, load.grant_bytes)
        if load.kv_blocks_total > want.state.kv_blocks:  # keep a larger cache the grant holds: a resize drains
            want = replace(want, state=replace(want.state, kv_blocks=load.kv_blocks_total))
        if load.max_batched_tokens:  # keep the step size the engine was configured with: the ceiling
            # took effect at its first restart unasked; prefill_bound moves it when TTFT says so
            want = replace(want, state=replace(want.state, max_batched_tokens=load.max_batched_tokens))
    else:
        for rule, fn in RULES:  # noqa: B007 - the matching rule is used after the loop
            got = fn(load, cfg, state)
            if got is not None:
                want = got
                break
        else:
            raise AssertionError("the last LLM rule always answers")
    new = _clamp(want.state, cfg, load.grant_bytes)
    if _settings(new) != (_settings(state) if state is not None else None):
        new = replace(new, last_change_s=load.now_s)
    busy_blocks = kv_blocks_in_grant(cfg, 1 << 62)  # the largest cache it may grow to
    want_blocks = busy_blocks if cache_pressed(load, cfg) else new.kv_blocks  # what it asks the lending planner for
    decision = LlmDecision(
        max_num_seqs=new.max_num_seqs,
        max_batched_tokens=new.max_batched_tokens,
        kv_blocks=new.kv_blocks,
        prefill_paused=new.prefill_paused,
        kv_cache_bytes=cache_bytes(cfg, new.kv_blocks),
        want_grant_bytes=cfg.base_bytes + cache_bytes(cfg, want_blocks),
        rule=rule,
        trigger=want.trigger,
        value=float(want.value),
        reason=want.reason,
    )
    return decision, new


def rule_config_for(
    expected_peak_concurrency: int,
    ttft_slo_ms: float,
    tpot_slo_ms: float,
    report: EngineReport,
    base_bytes: int = 0,
    seq_tokens: int | None = None,
    **overrides: Any,
) -> LlmRuleConfig:
    """Rule parameters from a model's ``llm`` objectives (gpubroker.quotas.config.LlmSpec) and its
    engine's report (``gpubroker.deployments.llm.server.engine_report``: geometry and ceilings).
    ``seq_tokens`` defaults to what the engine reports a sequence holds (``seq_tokens``: prompt
    plus output over its recent completions; vLLM allocates blocks as sequences grow), else to
    the context length, the worst case."""
    return LlmRuleConfig(
        expected_peak_concurrency=int(expected_peak_concurrency),
        ttft_slo_ms=float(ttft_slo_ms),
        tpot_slo_ms=float(tpot_slo_ms),
        kv_block_bytes=int(report.kv_block_bytes),
        kv_block_tokens=int(report.kv_block_tokens),
        seq_tokens=int(seq_tokens if seq_tokens is not None else report.seq_tokens or report.max_model_len),
        base_bytes=int(base_bytes),
        max_num_seqs_max=int(report.max_num_seqs_max),
        max_batched_tokens_max=int(report.max_batched_tokens_max),
        step_tokens_per_block=float(report.step_tokens_per_block or 0.0),
        kv_blocks_min=int(report.kv_cache_blocks_min),
        kv_blocks_max=int(report.kv_cache_blocks_max),
        **overrides,
    )


def load_from_report(
    report: EngineReport, now_s: float, free_mem_frac: float, grant_bytes: int, incoming_bytes: int = 0
) -> EngineLoad:
    """The rules' snapshot from an engine report plus what the broker knows (time, card, grant and
    the grant in flight to it)."""
    return EngineLoad(
        now_s=float(now_s),
        running=int(report.running),
        waiting=int(report.waiting),
        ttft_p95_ms=report.ttft_p95_ms,
        tpot_p95_ms=report.tpot_p95_ms,
        samples=int(report.samples),
        prefill_time_frac=float(report.prefill_time_frac),
        kv_blocks_total=int(report.kv_blocks_total),
        kv_blocks_reserved=int(report.kv_blocks_reserved),
        free_mem_frac=float(free_mem_frac),
        grant_bytes=int(grant_bytes),
        idle_for_s=float(report.idle_for_s),
        last_resize_s=float(report.last_restart_s or 0.0),
        incoming_bytes=int(incoming_bytes),
        max_batched_tokens=int(report.max_batched_tokens or 0),
    )


@dataclass(frozen=True)
class EngineRecord:
    """What an engine's rules decided last (``PolicyState.engines``)."""

    state: LlmState
    decision: LlmDecision
    last_rule: str  # the rule that answered last (a new rule holding is logged)

    def to_dict(self) -> dict[str, Any]:
        s, d = asdict(self.state), self.decision
        s["last_change_s"] = None if not math.isfinite(self.state.last_change_s) else self.state.last_change_s
        return {
            "state": s,
            "decision": {**asdict(d), "value": d.value if math.isfinite(d.value) else None},
            "last_rule": str(self.last_rule),
        }

    @classmethod
    def from_parts(cls, state: Mapping[str, Any], decision: Mapping[str, Any], last_rule: str) -> EngineRecord:
        s = dict(state)
        s["last_change_s"] = float("-inf") if s.get("last_change_s") is None else float(s["last_change_s"])
        raw = dict(
            decision,
            rule=LlmRule(decision["rule"]),
            trigger=LlmTrigger(decision["trigger"]),
            value=float(decision.get("value") or 0.0),
        )
        return cls(
            LlmState(**{k: v for k, v in s.items() if k in LlmState.__dataclass_fields__}),
            LlmDecision(**raw),
            last_rule,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineRecord:
        return cls.from_parts(data["state"], data["decision"], str(data.get("last_rule", "")))


def engines_from_llm_section(data: Mapping[str, Any] | None) -> dict[str, EngineRecord]:
    """The engine records of a checkpoint written before the engine state joined the policy
    state (its ``llm_state`` section: ``states``, ``decisions``, ``last_rule`` per model)."""
    data = data or {}
    states, decisions, rules = data.get("states", {}), data.get("decisions", {}), data.get("last_rule", {})
    return {
        n: EngineRecord.from_parts(states[n], decisions[n], str(rules.get(n, decisions[n]["rule"])))
        for n in decisions
        if n in states
    }
