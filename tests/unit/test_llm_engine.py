"""The CPU LLM engine on a real tiny Llama (2 layers, hidden 64, 260 byte-level ids) on cpu.

Each test runs its own event loop (``asyncio.run``) and its own engine; waits poll the
engine's state with a generous bound, never assert on a duration.
"""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest.importorskip("transformers")

from deployments.llm.cpu_engine import CpuEngine, CpuEngineOptions
from deployments.llm.engine import (
    EngineRequestError,
    FinishReason,
    LlmEngine,
    Sampling,
    TokenDelta,
)
from deployments.llm.tiny_model import BOS_ID, ByteTokenizer

TOK = ByteTokenizer()
PROMPT = TOK.encode("The quick brown fox")


def run(coro_fn, **options):
    """Start an engine with ``options``, run ``coro_fn(engine)``, stop the engine."""

    async def main():
        engine = CpuEngine(CpuEngineOptions(**options))
        await engine.start()
        try:
            return await coro_fn(engine)
        finally:
            await engine.stop()

    return asyncio.run(main())


async def until(pred, what: str, limit_s: float = 60.0):
    for _ in range(int(limit_s / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def first_token(stream) -> TokenDelta:
    delta = await stream.__anext__()
    assert delta.token_ids or delta.finished
    return delta


def test_engine_satisfies_the_protocol():
    assert isinstance(CpuEngine(), LlmEngine)


def test_greedy_output_alone_equals_output_inside_a_busy_batch():
    async def body(engine):
        alone, last = await engine.submit("alone", PROMPT, 24).collect()
        assert last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and alone
        others = [engine.submit(f"o{i}", TOK.encode("x" * (3 + 7 * i)), 30 - i) for i in range(6)]
        mine = engine.submit("busy", PROMPT, 24)
        more = [engine.submit(f"p{i}", TOK.encode("later " * (i + 1)), 12) for i in range(2)]
        assert engine.stats().running == 9  # all in flight together: batched with the others
        results = await asyncio.gather(mine.collect(), *(s.collect() for s in others + more))
        assert results[0][0] == alone
        return engine.stats()

    stats = run(body, max_num_seqs=16)
    assert stats.finished == 10 and stats.tokens_out > 0 and len(stats.ttft_ms) == 10


def test_prompt_plus_max_tokens_over_the_context_is_refused_naming_the_field():
    async def body(engine):
        ctx = engine.max_model_len
        with pytest.raises(EngineRequestError) as err:
            engine.submit("long", [BOS_ID] + [65] * (ctx - 10), 20)
        assert err.value.field == "max_tokens" and str(ctx) in err.value.message
        assert "lower max_tokens to at most 9" in err.value.message
        with pytest.raises(EngineRequestError) as err:
            engine.submit("empty", [], 5)
        assert err.value.field == "prompt"
        with pytest.raises(EngineRequestError) as err:
            engine.submit("hot", PROMPT, 5, sampling=Sampling(temperature=0.8))
        assert err.value.field == "temperature"
        tokens, _ = await engine.submit("fits", [BOS_ID] + [65] * (ctx - 11), 10).collect()
        assert len(tokens) <= 10
        return engine.stats()

    stats = run(body)
    assert stats.running == 0 and stats.waiting == 0


def test_squeeze_pauses_new_prefills_while_running_sequences_finish_decoding():
    async def body(engine):
        a, b = engine.submit("a", PROMPT, 40), engine.submit("b", TOK.encode("hello"), 40)
        await first_token(a), await first_token(b)
        bounds = engine.set_bounds(8, 256, prefill_paused=True)
        assert bounds.prefill_paused
        c, d = engine.submit("c", PROMPT, 8), engine.submit("d", PROMPT, 8)
        done = await asyncio.gather(a.collect(), b.collect())  # decodes finish under the squeeze
        assert all(last.finished and last.finish_reason is not FinishReason.CANCELLED for _, last in done)
        s = engine.stats()
        assert (s.running, s.waiting) == (0, 2)  # c and d were never prefilled
        assert s.tokens_in == len(PROMPT) + len(TOK.encode("hello"))
        engine.set_bounds(8, 256, prefill_paused=False)
        (tc, _), (td, _) = await asyncio.gather(c.collect(), d.collect())
        assert tc == td and tc  # same prompt, greedy: same tokens
        return engine.stats()

    stats = run(body)
    assert stats.finished == 4 and stats.waiting == 0


def test_a_cancelled_stream_frees_its_blocks():
    async def body(engine):
        s = engine.submit("long", TOK.encode("a fairly long prompt " * 4), 150)
        await first_token(s)
        await until(lambda: engine.stats().kv_blocks_used > 0, "the sequence holds KV blocks")
        assert engine.stats().kv_blocks_reserved == engine.blocks_for(len(TOK.encode("a fairly long prompt " * 4)), 150)
        engine.cancel("long")
        tokens, last = await s.collect()
        assert last.finish_reason is FinishReason.CANCELLED and len(tokens) < 150
        assert engine.stats().kv_blocks_reserved == 0
        await until(lambda: engine.stats().kv_blocks_used == 0, "the cache frees the cancelled sequence's blocks")
        # closing a stream early cancels its request the same way
        s2 = engine.submit("closed", PROMPT, 150)
        await first_token(s2)
        await s2.aclose()
        await until(lambda: engine.stats().kv_blocks_used == 0, "closing the stream frees its blocks")
        return engine.stats()

    stats = run(body)
    assert stats.cancelled == 2 and stats.running == 0


def test_set_bounds_is_honoured_never_more_than_max_num_seqs_running():
    async def body(engine):
        engine.set_bounds(2, 64)
        seen: list[int] = []

        async def consume(stream):
            async for _ in stream:
                seen.append(engine.stats().running)

        streams = [engine.submit(f"r{i}", TOK.encode(f"prompt number {i}"), 10) for i in range(6)]
        s = engine.stats()
        assert (s.running, s.waiting, s.max_num_seqs, s.max_batched_tokens) == (2, 4, 2, 64)
        await asyncio.gather(*(consume(st) for st in streams[:3]))
        assert max(seen) <= 2
        engine.set_bounds(3, 128)
        assert engine.stats().running <= 3
        seen.clear()
        await asyncio.gather(*(consume(st) for st in streams[3:]))
        assert seen and max(seen) <= 3
        return engine.stats()

    stats = run(body, max_num_seqs=8)
    assert stats.finished == 6


def test_kv_cache_resize_waits_for_a_drain_and_keeps_greedy_output():
    async def body(engine):
        before, _ = await engine.submit("before", PROMPT, 16).collect()
        long = engine.submit("long", PROMPT, 40)
        await first_token(long)
        assert engine.set_kv_cache_blocks(8) == 8
        held = engine.submit("held", PROMPT, 16)
        assert engine.stats().waiting == 1  # nothing new is admitted while the cache waits to drain
        await long.collect()
        after, _ = await held.collect()
        s = engine.stats()
        assert (s.kv_blocks_total, s.rebuilds) == (8, 1)
        assert after == before  # same weights, same greedy output on the rebuilt cache
        cache = engine._manager.batch_processor.cache
        assert engine.kv_cache_bytes() == cache.cache_tensor.numel() * cache.cache_tensor.element_size()
        return s

    run(body, kv_cache_blocks=32)


def test_a_failed_cache_rebuild_keeps_serving_on_the_old_size():
    async def body(engine):
        build = engine._build_manager

        def failing(num_blocks):
            if num_blocks == 8:
                raise MemoryError("no room for the new cache")
            return build(num_blocks)

        engine._build_manager = failing
        engine.set_kv_cache_blocks(8)
        await engine.wait_rebuilt()
        s = engine.stats()
        assert (s.kv_blocks_total, s.kv_blocks_target, s.rebuilds) == (32, 32, 0)
        tokens, last = await engine.submit("after", PROMPT, 8).collect()
        assert tokens and last.finish_reason is not FinishReason.ERROR

    run(body, kv_cache_blocks=32)


def test_a_request_sent_during_a_cache_rebuild_waits_and_runs_after():
    async def body(engine):
        engine.set_kv_cache_blocks(8)  # idle: the rebuild starts at once
        await until(lambda: engine._manager is None, "the old manager is stopped for the rebuild")
        during = engine.submit("during", PROMPT, 8)  # not refused: it waits for the new cache
        assert engine.stats().waiting == 1
        tokens, last = await during.collect()
        assert tokens and last.finish_reason is not FinishReason.ERROR
        assert (engine.stats().kv_blocks_total, engine.stats().rebuilds) == (8, 1)

    run(body, kv_cache_blocks=32)
