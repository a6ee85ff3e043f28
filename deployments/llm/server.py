"""The Serve deployment that hosts one LLM engine: generation, token streams, bounds, stats.

``LlmServer`` owns the engine and its tokenizer. The OpenAI ingress (``openai_api``) sends it
validated request bodies; it tokenises, submits, and returns OpenAI-shaped bodies, or, for
``stream: true``, yields the server-sent events. A request the engine refuses comes back as
``{"status": 400, "body": <OpenAI error naming the field>}`` (the stream's first item says
the same), so the ingress can answer 400 before any event is sent.

The broker's side: ``report()`` returns the engine's stats with TTFT/TPOT percentiles and
the KV cache in bytes; ``apply`` (a ``broker.llm_rules.LlmDecision`` as a dict), or
``apply_bounds`` / ``apply_kv_cache_blocks``, change the running engine. Nothing calls them on a timer here: the broker drives them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, fields
from typing import Any

from deployments.llm.cpu_engine import CpuEngine, CpuEngineOptions
from deployments.llm.engine import (
    EngineRequestError,
    FinishReason,
    Sampling,
    percentile,
)
from deployments.llm.tiny_model import ByteTokenizer, TinyLlamaSpec

COMPLETION, CHAT = "completion", "chat"


def engine_options(options: dict[str, Any]) -> CpuEngineOptions:
    """A model's ``options`` as engine options: model-shape keys go to ``TinyLlamaSpec``."""
    model_keys = {f.name for f in fields(TinyLlamaSpec)}
    engine_keys = {f.name for f in fields(CpuEngineOptions)} - {"model"}
    unknown = sorted(set(options) - model_keys - engine_keys)
    if unknown:
        raise ValueError(f"options {unknown} are not engine options; known: {', '.join(sorted(model_keys | engine_keys))}")
    spec = TinyLlamaSpec(**{k: v for k, v in options.items() if k in model_keys})
    return CpuEngineOptions(model=spec, **{k: v for k, v in options.items() if k in engine_keys})


def openai_error(field: str, message: str, status: int = 400) -> dict[str, Any]:
    return {"status": status, "body": {"error": {"message": message, "type": "invalid_request_error",
                                                 "param": field, "code": None}}}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def engine_report(engine: CpuEngine, idle_for_s: float, name: str = "") -> dict[str, Any]:
    """Engine stats as a JSON-safe dict: the ``EngineStats`` counters and bounds, TTFT/TPOT
    P50/P95/P99 over the recent completions, the KV cache in bytes, the engine's ceilings and
    geometry (what ``broker.llm_rules.rule_config_for`` and ``load_from_report`` read)."""
    s = engine.stats()
    out = asdict(s)
    out.pop("ttft_ms"), out.pop("tpot_ms")
    for metric, samples in (("ttft", s.ttft_ms), ("tpot", s.tpot_ms)):
        for q in (50, 95, 99):
            out[f"{metric}_p{q}_ms"] = percentile(samples, q)
    o = engine.options
    out.update(model=name, samples=len(s.ttft_ms), kv_blocks_free=s.kv_blocks_free,
               prefill_time_frac=s.prefill_time_frac, kv_cache_bytes=engine.kv_cache_bytes(),
               max_model_len=engine.max_model_len, max_num_seqs_max=o.max_num_seqs_max,
               max_batched_tokens_max=o.max_batched_tokens_max, kv_cache_blocks_min=o.kv_cache_blocks_min,
               kv_cache_blocks_max=o.kv_cache_blocks_max, idle_for_s=float(idle_for_s))
    return out


class LlmServer:
    """One engine behind Serve (wrap with ``serve.deployment``; see ``openai_api.build_llm_app``)."""

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        self.name = name
        self.engine = CpuEngine(engine_options(dict(options or {})))
        self.tok = ByteTokenizer()
        self._started = False
        self._lock = asyncio.Lock()
        self._last_active_s = time.monotonic()

    async def _ready(self) -> None:
        if not self._started:
            async with self._lock:
                if not self._started:
                    await self.engine.start()
                    self._started = True

    async def check_health(self) -> None:  # Serve's health check: the engine's loop must be alive
        if self._started and self.engine._manager is not None and not self.engine._manager.is_running():
            raise RuntimeError(f"{self.name}: the continuous batching thread died")

    # ---------------------------------------------------------------- requests

    def _prompt_ids(self, kind: str, body: dict[str, Any]) -> list[int]:
        if kind == CHAT:
            return self.tok.encode_chat([(m["role"], m["content"]) for m in body["messages"]])
        prompt = body["prompt"]
        if isinstance(prompt, list):  # token ids
            return [int(t) for t in prompt]
        return self.tok.encode(prompt)

    def _submit(self, kind: str, body: dict[str, Any]):
        """(request id, prompt ids, stream), or an error dict."""
        ids = self._prompt_ids(kind, body)
        rid = f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        sampling = Sampling(temperature=float(body.get("temperature") or 0.0), top_p=float(body.get("top_p") or 1.0))
        try:
            stream = self.engine.submit(rid, ids, int(body["max_tokens"]), sampling)
        except EngineRequestError as exc:
            field = "messages" if (exc.field == "prompt" and kind == CHAT) else exc.field
            return openai_error(field, f"{field}: {exc.message} (got {exc.value!r})" if field != "max_tokens"
                                else f"max_tokens: {exc.message}")
        self._last_active_s = time.monotonic()
        return rid, ids, stream

    def _envelope(self, kind: str, rid: str, created: int) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion" if kind == CHAT else "text_completion",
                "created": created, "model": self.name}

    async def generate(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """A whole completion: ``{"status": 200, "body": <OpenAI response>}`` or an error dict."""
        await self._ready()
        got = self._submit(kind, body)
        if isinstance(got, dict):
            return got
        rid, ids, stream = got
        try:
            tokens, last = await stream.collect()
        finally:
            await stream.aclose()  # a cancelled caller cancels the sequence
        if last.finish_reason is FinishReason.ERROR:
            return {"status": 500, "body": {"error": {"message": last.error, "type": "server_error", "param": None, "code": None}}}
        text = self.tok.decode(tokens)
        reason = "stop" if last.finish_reason is FinishReason.STOP else "length"
        out = self._envelope(kind, rid, int(time.time()))
        if kind == CHAT:
            out["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}]
        else:
            out["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]
        out["usage"] = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        return {"status": 200, "body": out}

    async def generate_stream(self, kind: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        """First item: ``{"status": 200}`` or an error dict; then SSE strings, ending in ``data: [DONE]``.
        Cancelling the consumer (the client went away) cancels the sequence and frees its blocks."""
        await self._ready()
        got = self._submit(kind, body)
        if isinstance(got, dict):
            yield got
            return
        rid, _, stream = got
        yield {"status": 200}
        created = int(time.time())
        decoder = self.tok.stream_decoder()
        env = dict(self._envelope(kind, rid, created), object="chat.completion.chunk" if kind == CHAT else "text_completion")
        try:
            if kind == CHAT:
                yield _sse(dict(env, choices=[{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]))
            async for delta in stream:
                text = decoder.feed(delta.token_ids, final=delta.finished)
                reason = None
                if delta.finished:
                    reason = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(delta.finish_reason, "error")
                if not text and reason is None:
                    continue
                if kind == CHAT:
                    choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": reason}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
                yield _sse(dict(env, choices=[choice]))
            yield DONE
        finally:
            await stream.aclose()

    # ---------------------------------------------------------------- broker side

    async def report(self) -> dict[str, Any]:
        """``engine_report`` of this server's engine (for the broker and status)."""
        await self._ready()
        busy = self.engine.stats().running or self.engine.stats().waiting
        if busy:
            self._last_active_s = time.monotonic()
        return engine_report(self.engine, 0.0 if busy else time.monotonic() - self._last_active_s, self.name)

    async def apply(self, decision: dict[str, Any]) -> dict[str, Any]:
        """Apply a broker decision (``broker.llm_rules.LlmDecision`` as a dict): bounds now, the
        KV cache size at the next drain. Returns the bounds and cache target as applied."""
        await self._ready()
        bounds = self.engine.set_bounds(int(decision["max_num_seqs"]), int(decision["max_batched_tokens"]),
                                        bool(decision["prefill_paused"]))
        target = self.engine.set_kv_cache_blocks(int(decision["kv_blocks"]))
        return dict(asdict(bounds), kv_blocks_target=target)

    async def apply_bounds(self, max_num_seqs: int, max_batched_tokens: int, prefill_paused: bool = False) -> dict[str, Any]:
        await self._ready()
        return asdict(self.engine.set_bounds(max_num_seqs, max_batched_tokens, prefill_paused))

    async def apply_kv_cache_blocks(self, num_blocks: int) -> int:
        await self._ready()
        return self.engine.set_kv_cache_blocks(num_blocks)
