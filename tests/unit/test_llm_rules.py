"""gpubroker.broker.control.llm_rules: one test per rule, with override builders and integer-tick times."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpubroker.broker.control.llm_rules import (
    RULES,
    EngineLoad,
    LlmRule,
    LlmRuleConfig,
    LlmState,
    LlmTrigger,
    cache_bytes,
    decide_llm,
    kv_blocks_in_grant,
    rule_config_for,
    seqs_in_grant,
)
from gpubroker.broker.wire import EngineReport

BLOCK = 8192  # bytes per block
CFG = LlmRuleConfig(
    expected_peak_concurrency=16,
    ttft_slo_ms=500.0,
    tpot_slo_ms=50.0,
    kv_block_bytes=BLOCK,
    kv_block_tokens=16,
    seq_tokens=64,
    base_bytes=1_000_000,
    kv_blocks_max=256,
)
BIG_GRANT = CFG.base_bytes + (256 + 2) * BLOCK  # room for the largest cache


def load(**over) -> EngineLoad:
    base = {
        "now_s": 100.0,
        "running": 4,
        "waiting": 0,
        "ttft_p95_ms": 100.0,
        "tpot_p95_ms": 10.0,
        "samples": 50,
        "prefill_time_frac": 0.2,
        "kv_blocks_total": 64,
        "kv_blocks_reserved": 16,
        "free_mem_frac": 0.5,
        "grant_bytes": BIG_GRANT,
        "idle_for_s": 0.0,
    }
    base.update(over)
    return EngineLoad(**base)


def state(**over) -> LlmState:
    base = {
        "max_num_seqs": 8,
        "max_batched_tokens": 256,
        "kv_blocks": 64,
        "prefill_paused": False,
        "recover_to": 0,
        "last_change_s": 0.0,
    }
    base.update(over)
    return LlmState(**base)


def test_start_is_half_the_expected_peak_when_memory_allows():
    d, s = decide_llm(load(), CFG, None)
    assert d.rule is LlmRule.START and d.trigger is LlmTrigger.EXPECTED_PEAK
    assert d.max_num_seqs == 8  # 50% of 16
    assert "expected_peak_concurrency 16" in d.reason
    assert d.kv_blocks == 16 * CFG.blocks_per_seq  # sized for the peak, inside the grant
    assert s.max_num_seqs == 8 and s.last_change_s == 100.0


def test_start_is_capped_by_what_the_grant_holds():
    grant = CFG.base_bytes + (3 * CFG.blocks_per_seq + 2) * BLOCK  # three sequences' reservations
    d, _ = decide_llm(load(grant_bytes=grant), CFG, None)
    assert seqs_in_grant(CFG, grant) == 3
    assert d.max_num_seqs == 3 and "memory allows 3" in d.reason
    assert d.kv_cache_bytes <= grant - CFG.base_bytes  # the cache stays inside the grant


def test_squeeze_halves_and_pauses_prefills_under_15_percent_free():
    d, s = decide_llm(load(free_mem_frac=0.10), CFG, state(max_num_seqs=8))
    assert d.rule is LlmRule.SQUEEZE and d.trigger is LlmTrigger.FREE_MEM_FRAC
    assert d.max_num_seqs == 4 and d.prefill_paused
    assert "free_mem_frac 0.100" in d.reason
    assert s.recover_to == 8
    # still under within hold_s: no second halving
    d2, _ = decide_llm(load(now_s=101.0, free_mem_frac=0.10), CFG, s)
    assert d2.rule is LlmRule.SQUEEZE and d2.max_num_seqs == 4 and d2.prefill_paused


def test_resume_admits_again_once_headroom_returns_and_holds_in_the_band():
    paused = state(max_num_seqs=4, prefill_paused=True, recover_to=8)
    d_band, _ = decide_llm(load(free_mem_frac=0.20), CFG, paused)
    assert d_band.rule is LlmRule.RESUME and d_band.prefill_paused  # 0.15 <= free < 0.25: stay paused
    d, s = decide_llm(load(free_mem_frac=0.30), CFG, paused)
    assert d.rule is LlmRule.RESUME and not d.prefill_paused
    assert d.max_num_seqs == 4  # bound stays halved: recovery is step by step
    assert "free_mem_frac 0.300" in d.reason and s.recover_to == 8


def test_prefill_bound_lowers_seqs_and_tokens_when_ttft_breaches_and_tpot_is_fine():
    d, _ = decide_llm(load(ttft_p95_ms=900.0, tpot_p95_ms=20.0, prefill_time_frac=0.7), CFG, state())
    assert d.rule is LlmRule.PREFILL_BOUND and d.trigger is LlmTrigger.TTFT_P95_MS
    assert d.max_num_seqs == 6 and d.max_batched_tokens == 128
    assert "ttft_p95_ms 900.0" in d.reason
    # decode slow too: not this rule
    d2, _ = decide_llm(load(ttft_p95_ms=900.0, tpot_p95_ms=80.0, prefill_time_frac=0.7), CFG, state())
    assert d2.rule is not LlmRule.PREFILL_BOUND


def test_recover_steps_max_num_seqs_back_after_a_squeeze():
    s = state(max_num_seqs=4, recover_to=8, last_change_s=0.0)
    d, s1 = decide_llm(load(now_s=10.0), CFG, s)
    assert d.rule is LlmRule.RECOVER and d.max_num_seqs == 6 and s1.recover_to == 8
    d2, s2 = decide_llm(load(now_s=11.0), CFG, s1)  # within hold_s: hold
    assert d2.rule is LlmRule.RECOVER and d2.max_num_seqs == 6
    d3, s3 = decide_llm(load(now_s=13.0), CFG, s2)
    assert d3.max_num_seqs == 8 and s3.recover_to == 0
    assert "free_mem_frac 0.500" in d3.reason


def test_idle_shrinks_the_kv_cache_to_lend():
    d, _ = decide_llm(load(running=0, waiting=0, idle_for_s=6.0, kv_blocks_reserved=0), CFG, state(kv_blocks=64))
    assert d.rule is LlmRule.IDLE_SHRINK and d.trigger is LlmTrigger.IDLE_FOR_S
    assert d.kv_blocks == CFG.kv_blocks_min
    assert d.want_grant_bytes == CFG.base_bytes + cache_bytes(CFG, CFG.kv_blocks_min)  # what it keeps
    assert "idle_for_s 6.0" in d.reason


def test_idle_shrink_keeps_what_the_quota_min_holds():
    floor_grant = CFG.base_bytes + cache_bytes(CFG, 40)  # the quota min holds a 40-block cache
    cfg = replace(CFG, lend_floor_bytes=floor_grant)
    idle = load(running=0, waiting=0, idle_for_s=6.0, kv_blocks_reserved=0)
    d, _ = decide_llm(idle, cfg, state(kv_blocks=64))
    assert d.rule is LlmRule.IDLE_SHRINK and d.kv_blocks == 40
    d, _ = decide_llm(idle, cfg, state(kv_blocks=40))  # at its floor: a fixed quota (min = base) never shrinks
    assert d.rule is not LlmRule.IDLE_SHRINK and d.kv_blocks == 40


def test_idle_shrink_waits_twice_the_last_resize():
    slow = load(running=0, waiting=0, idle_for_s=30.0, kv_blocks_reserved=0, last_resize_s=20.0)
    d, _ = decide_llm(slow, CFG, state(kv_blocks=64))
    assert d.rule is not LlmRule.IDLE_SHRINK and d.kv_blocks == 64  # 30 s idle < 2 x 20 s of resize
    d, _ = decide_llm(replace(slow, idle_for_s=41.0), CFG, state(kv_blocks=64))
    assert d.rule is LlmRule.IDLE_SHRINK and "idle_for_s 41.0 >= 40" in d.reason


def test_busy_grows_the_kv_cache_up_to_what_the_grant_allows():
    grant = CFG.base_bytes + (100 + 2) * BLOCK
    d, _ = decide_llm(load(waiting=5, running=8, kv_blocks_reserved=40, grant_bytes=grant), CFG, state(kv_blocks=64))
    assert d.rule is LlmRule.BUSY_GROW and d.trigger is LlmTrigger.WAITING  # 40 + 5 x 4 blocks >= 0.8 x 64
    assert d.kv_blocks == kv_blocks_in_grant(CFG, grant) == 100  # doubling capped by the grant
    assert d.want_grant_bytes == CFG.base_bytes + cache_bytes(CFG, 256)  # asks for its max
    assert "waiting 5" in d.reason


def test_seqs_grow_when_waiting_behind_the_bound_with_slos_met():
    s = state(max_num_seqs=8, kv_blocks=256)  # cache already at its max: busy_grow cannot match
    d, _ = decide_llm(load(waiting=3, running=8), CFG, s)
    assert d.rule is LlmRule.SEQS_GROW and d.max_num_seqs == 10
    assert "waiting 3" in d.reason


def test_hold_when_nothing_to_do():
    d, s = decide_llm(load(), CFG, state())
    assert d.rule is LlmRule.HOLD and d.trigger is LlmTrigger.HOLD
    assert not d.bounds_changed(state()) and s.last_change_s == 0.0


def test_guard_rails_keep_every_rule_inside_the_grant():
    small = CFG.base_bytes + (10 + 2) * BLOCK
    d, _ = decide_llm(load(grant_bytes=small), CFG, state(max_num_seqs=30, kv_blocks=200))
    assert d.kv_blocks <= 10 and d.max_num_seqs <= seqs_in_grant(CFG, small)


def test_every_rule_in_the_table_has_a_test_here():
    import sys

    names = " ".join(n for n in dir(sys.modules[__name__]) if n.startswith("test_"))
    short = {
        LlmRule.PREFILL_BOUND: "prefill_bound",
        LlmRule.IDLE_SHRINK: "idle",
        LlmRule.BUSY_GROW: "busy",
        LlmRule.SEQS_GROW: "seqs_grow",
    }
    for rule, _ in RULES:
        assert short.get(rule, rule.value) in names, f"rule {rule} has no test"


@pytest.mark.parametrize("free", [0.05, 0.149])
def test_squeeze_comes_first_even_when_ttft_breaches(free):
    d, _ = decide_llm(load(free_mem_frac=free, ttft_p95_ms=900.0, prefill_time_frac=0.9), CFG, replace(state()))
    assert d.rule is LlmRule.SQUEEZE


def test_busy_grow_waits_when_the_grant_allows_only_a_small_gain():
    grant = CFG.base_bytes + (70 + 2) * BLOCK  # 64 -> 70 blocks: under the 50% a drain is worth
    d, _ = decide_llm(load(waiting=5, running=8, kv_blocks_reserved=40, grant_bytes=grant), CFG, state(kv_blocks=64))
    assert d.rule is not LlmRule.BUSY_GROW and d.kv_blocks == 64


def test_seqs_grow_by_half_a_long_queue_at_most_doubling():
    s = state(max_num_seqs=8, kv_blocks=256)
    d, _ = decide_llm(load(waiting=30, running=8), CFG, s)
    assert d.rule is LlmRule.SEQS_GROW and d.max_num_seqs == 12  # 8 + min(30, 8) // 2


def test_start_keeps_the_engines_max_batched_tokens_not_its_ceiling():
    """The first decision keeps the step size the engine runs (configured by its operator): the
    ceiling used to take effect at the engine's first restart, unasked."""
    d, _ = decide_llm(load(max_batched_tokens=512), CFG, None)
    assert d.rule is LlmRule.START and d.max_batched_tokens == 512
    d, _ = decide_llm(load(), CFG, None)  # an engine that reports none: the ceiling, as before
    assert d.max_batched_tokens == CFG.max_batched_tokens_max


def test_start_keeps_a_larger_cache_the_grant_holds():
    d, _ = decide_llm(load(kv_blocks_total=200, grant_bytes=BIG_GRANT), CFG, None)
    assert d.rule is LlmRule.START and d.kv_blocks == 200  # no resize (a drain) at the first decision


def test_busy_grow_only_when_the_cache_binds_not_for_a_stray_request():
    """An engine that shrank to lend keeps its small cache (and asks for no more) when a request
    arrives that fits it; a queue that would fill the cache grows it and asks for the engine's max."""
    grant = CFG.base_bytes + (64 + 2) * BLOCK
    shrunk = state(kv_blocks=8)
    stray = load(running=0, waiting=1, kv_blocks_total=8, kv_blocks_reserved=0, grant_bytes=grant)
    d, _ = decide_llm(stray, CFG, shrunk)  # 0 + 1 x 4 blocks < 0.8 x 8
    assert d.rule is not LlmRule.BUSY_GROW and d.kv_blocks == 8
    assert d.want_grant_bytes == CFG.base_bytes + cache_bytes(CFG, 8)
    queue = replace(stray, running=1, waiting=2, kv_blocks_reserved=4)  # 4 + 2 x 4 >= 6.4
    d, _ = decide_llm(queue, CFG, shrunk)
    assert d.rule is LlmRule.BUSY_GROW and d.kv_blocks == 64
    assert d.want_grant_bytes == CFG.base_bytes + cache_bytes(CFG, 256)


def test_a_queue_behind_max_num_seqs_alone_does_not_grow_the_cache():
    d, _ = decide_llm(load(waiting=3, running=8, kv_blocks_reserved=16), CFG, state(kv_blocks=64))
    assert d.rule is LlmRule.SEQS_GROW and d.kv_blocks == 64  # 16 + 3 x 4 < 0.8 x 64: seqs, not cache


def test_busy_grow_raises_max_num_seqs_to_what_the_grown_cache_holds():
    """The sequences waiting for blocks run once the cache holds them, not a seqs_grow step of 2 s at a time."""
    grant = CFG.base_bytes + (100 + 2) * BLOCK
    d, _ = decide_llm(load(waiting=50, running=8, kv_blocks_reserved=60, grant_bytes=grant), CFG, state(kv_blocks=64))
    assert d.rule is LlmRule.BUSY_GROW and d.max_num_seqs == 100 // CFG.blocks_per_seq == 25
    d, _ = decide_llm(load(waiting=5, running=8, kv_blocks_reserved=60, grant_bytes=grant), CFG, state(kv_blocks=64))
    assert d.rule is LlmRule.BUSY_GROW and d.max_num_seqs == 8 + 5  # no more than what waits
    assert "max_num_seqs 8->13" in d.reason


def test_busy_grow_waits_for_the_grant_in_flight_and_grows_once_when_it_lands():
    """A bursting engine whose base came back while a lend to it was already begun grew to its base
    (a drain and restart) and again a few seconds later when the lend landed: two restarts in the
    first seconds of its burst (2026-12-05 runs). With grant in flight it keeps its cache and grows
    once, to what the landed grant holds."""
    pressed = dict(waiting=5, running=8, kv_blocks_reserved=40)
    grant = CFG.base_bytes + (100 + 2) * BLOCK
    d, s = decide_llm(load(grant_bytes=grant, incoming_bytes=80 * BLOCK, **pressed), CFG, state(kv_blocks=64))
    assert d.rule is LlmRule.BUSY_GROW and d.kv_blocks == 64 and s.last_change_s == 0.0  # no resize yet
    assert "in flight" in d.reason and "then 180" in d.reason
    assert d.want_grant_bytes == CFG.base_bytes + cache_bytes(CFG, 256)  # still asks for its max
    d, _ = decide_llm(load(grant_bytes=grant + 80 * BLOCK, **pressed), CFG, s)  # landed
    assert d.rule is LlmRule.BUSY_GROW and d.kv_blocks == 180


def test_grant_in_flight_that_adds_no_block_does_not_hold_a_grow():
    grant = CFG.base_bytes + (100 + 2) * BLOCK
    d, _ = decide_llm(
        load(waiting=5, running=8, kv_blocks_reserved=40, grant_bytes=grant, incoming_bytes=BLOCK // 2),
        CFG,
        state(kv_blocks=64),
    )
    assert d.rule is LlmRule.BUSY_GROW and d.kv_blocks == 100


def test_busy_grow_grows_the_step_with_the_cache_within_its_ceiling():
    """The step keeps the share of the cache the options gave it (here 4 tokens a block: 256 at 64
    blocks), never over max_batched_tokens_max nor below the step in force; without that share it stays."""
    grant = CFG.base_bytes + (100 + 2) * BLOCK
    busy = load(waiting=5, running=8, kv_blocks_reserved=40, grant_bytes=grant)
    d, _ = decide_llm(busy, replace(CFG, step_tokens_per_block=4.0), state(kv_blocks=64))
    assert d.rule is LlmRule.BUSY_GROW and d.kv_blocks == 100 and d.max_batched_tokens == 400
    assert "max_batched_tokens 256->400" in d.reason
    d, _ = decide_llm(busy, replace(CFG, step_tokens_per_block=8.0), state(kv_blocks=64))
    assert d.max_batched_tokens == CFG.max_batched_tokens_max == 512  # 800 over the ceiling
    d, _ = decide_llm(busy, replace(CFG, step_tokens_per_block=1.0), state(kv_blocks=64))
    assert d.max_batched_tokens == 256  # 100 under the step in force: keep it
    d, _ = decide_llm(busy, CFG, state(kv_blocks=64))
    assert d.rule is LlmRule.BUSY_GROW and d.max_batched_tokens == 256  # no share reported: the step stays


def test_rule_config_reads_the_step_share_from_the_engine_report():
    report = EngineReport(
        running=0,
        waiting=0,
        kv_blocks_total=16,
        kv_blocks_reserved=0,
        kv_block_bytes=BLOCK,
        kv_block_tokens=16,
        max_model_len=64,
        max_num_seqs_max=64,
        max_batched_tokens_max=2048,
        kv_cache_blocks_min=4,
        kv_cache_blocks_max=256,
    )
    assert rule_config_for(16, 500.0, 50.0, report).step_tokens_per_block == 0.0  # an older report
    assert rule_config_for(16, 500.0, 50.0, replace(report, step_tokens_per_block=64.0)).step_tokens_per_block == 64.0
