"""The Serve deployment that hosts one LLM engine: generation, token streams, bounds, stats.

``LlmServer`` owns the engine and its tokenizer. The OpenAI ingress (``openai_api``) sends it
validated request bodies; it tokenises, submits, and returns OpenAI-shaped bodies, or, for
``stream: true``, yields the server-sent events. A request the engine refuses comes back as
``{"status": 400, "body": <OpenAI error naming the field>}`` (the stream's first item says
the same), so the ingress can answer 400 before any event is sent.

The broker's side is the report/reply path every replica uses (``gpubroker.deployments.llm.report_loop``):
built with the fleet's config, the server sends one report per ``report_interval_s``
(its request counters and ``engine_report``) and applies the engine bounds in the reply
(``ModelSettings.engine``) with ``apply``, a local method. The broker never calls the server.
``report()`` is the engine report for status pages (``GET /v1/llm/{model}/stats``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, cast

from gpubroker.broker.wire import EngineReport, ModelSettings
from gpubroker.deployments.llm.engine import (
    EngineRequestError,
    FinishReason,
    Sampling,
    TokenDelta,
    percentile,
)
from gpubroker.deployments.llm.engine_config import engine_options
from gpubroker.deployments.llm.report_loop import EngineReporter, engine_link
from gpubroker.deployments.llm.vllm_engine import VllmEngine

if TYPE_CHECKING:
    from gpubroker.quotas.config import FleetConfig

COMPLETION, CHAT = "completion", "chat"


def openai_error(field: str, message: str, status: int = 400) -> dict[str, Any]:
    return {
        "status": status,
        "body": {"error": {"message": message, "type": "invalid_request_error", "param": field, "code": None}},
    }


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
FAILED = (FinishReason.ERROR, FinishReason.SHED)  # ends that count as a failed request, not a completion


def server_error(message: str | None, status: int = 500, code: str | None = None) -> dict[str, Any]:
    """A failure of the server's side in OpenAI's error shape."""
    return {
        "status": status,
        "body": {"error": {"message": message, "type": "server_error", "param": None, "code": code}},
    }


def overloaded(message: str | None) -> dict[str, Any]:
    """A request the engine shed unstarted (``max_queue_wait_ms``): OpenAI's answer to overload, a 503."""
    return server_error(message, 503, "overloaded")


async def _after(first: TokenDelta | None, rest: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
    """``first`` (already taken from the stream), then the rest of the stream."""
    if first is None:
        return
    yield first
    if not first.finished:
        async for delta in rest:
            yield delta


def engine_report(engine: VllmEngine, idle_for_s: float, name: str = "") -> EngineReport:
    """Engine stats as a JSON-safe dict: the ``EngineStats`` counters and bounds, TTFT/TPOT
    P50/P95/P99 over the recent completions, the KV cache in bytes, the engine's ceilings and
    geometry (what ``gpubroker.broker.control.llm_rules.rule_config_for`` and ``load_from_report`` read)."""
    s = engine.stats()
    out = asdict(s)
    out.pop("ttft_ms"), out.pop("tpot_ms")
    for metric, samples in (("ttft", s.ttft_ms), ("tpot", s.tpot_ms)):
        for q in (50, 95, 99):
            out[f"{metric}_p{q}_ms"] = percentile(samples, q)
    o = engine.options
    out.update(
        model=name,
        samples=len(s.ttft_ms),
        kv_blocks_free=s.kv_blocks_free,
        prefill_time_frac=s.prefill_time_frac,
        kv_cache_bytes=engine.kv_cache_bytes(),
        max_model_len=engine.max_model_len,
        max_num_seqs_max=o.max_num_seqs_max,
        max_batched_tokens_max=o.max_batched_tokens_max,
        step_tokens_per_block=o.max_batched_tokens / o.kv_cache_blocks,
        kv_cache_blocks_min=o.kv_cache_blocks_min,
        kv_cache_blocks_max=o.kv_cache_blocks_max,
        idle_for_s=float(idle_for_s),
        # what a sequence holds in the cache, for the rules' blocks per sequence (None: the worst case)
        seq_tokens=math.ceil(s.seq_tokens_mean) if s.seq_tokens_mean else None,
    )
    return cast(EngineReport, out)


class LlmServer:
    """One engine behind Serve (wrap with ``serve.deployment``; see ``openai_api.build_llm_app``)."""

    def __init__(
        self,
        name: str,
        options: dict[str, Any] | None = None,
        cfg: FleetConfig | None = None,
        card_id: str = "",
        get_broker: Callable[[], Any] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        model: str = "tiny-llama",
    ):
        """``cfg``: the fleet config, typed (``openai_api.build_llm_fleet`` binds it); the engine is
        the model's (its ``model``, ``engine_kwargs``, ``options``, ``llm``:
        ``engine_config.engine_options``) and the server reports to the broker (``get_broker``, by
        default the broker actor the config names).
        Without it, ``options``, ``engine_kwargs`` and ``model`` give the engine."""
        self.name = name
        self.reporter: EngineReporter | None = None
        if cfg is not None:
            if name not in cfg.models or cfg.models[name].kind != "llm":
                raise ValueError(
                    f"model '{name}' is not a kind: llm model of the config; LLMs: "
                    f"{', '.join(n for n, m in cfg.models.items() if m.kind == 'llm') or 'none'}"
                )
            spec = cfg.models[name]
            opts = engine_options(dict(spec.options), dict(spec.engine_kwargs), spec.model, spec.llm, cfg.gpu.device)
        else:
            opts = engine_options(dict(options or {}), engine_kwargs, model)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights and tokenizer from disk only
        self.engine = VllmEngine(opts)
        self.tok = _tokenizer(str(opts.engine_kwargs.get("tokenizer") or opts.model_dir))
        self._started = False
        self._starting: asyncio.Task | None = None
        self._last_active_s = time.monotonic()
        self._report_task: asyncio.Task | None = None
        if cfg is not None:
            broker = cfg.broker
            handle = get_broker or (lambda: _broker_actor(broker.name, broker.namespace))
            self.reporter = EngineReporter(
                self.engine,
                engine_link(name, _replica_id(name), handle, broker.report_interval_s, card_id),
                report_interval_s=broker.report_interval_s,
                engine_report=self._engine_report,
            )

    async def _ready(self) -> None:
        if not self._started:
            await asyncio.shield(self._start_task())
            self._started = True

    def _start_task(self) -> asyncio.Task:
        """The engine's start (vLLM takes tens of seconds), begun once, in the background."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())
        return self._starting

    async def _start(self) -> None:
        await self.engine.start()
        if self.reporter is not None:
            self._report_task = asyncio.get_running_loop().create_task(self.reporter.run())

    async def check_health(self) -> None:  # Serve's health check: the engine must be alive
        task = self._start_task()  # the first check begins the start and returns: it outlasts a check's timeout
        if task.done() and task.exception() is not None:
            raise RuntimeError(f"{self.name}: vLLM did not start: {task.exception()}")
        if task.done() and not self.engine.is_running():
            raise RuntimeError(f"{self.name}: vLLM's engine core died")

    async def __del__(self) -> None:
        """Serve's replica shutdown: stop vLLM, whose engine core is a process of its own (left
        running, it would outlive the replica)."""
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)
            await self.engine.stop()

    # ---------------------------------------------------------------- requests

    def _prompt_ids(self, kind: str, body: dict[str, Any]) -> list[int]:
        if kind == CHAT:  # the model's chat template, then its tokenizer
            text = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            return list(self.tok(text, add_special_tokens=False)["input_ids"])
        prompt = body["prompt"]
        if isinstance(prompt, list):  # token ids
            return [int(t) for t in prompt]
        return list(self.tok(prompt)["input_ids"])

    def _submit(self, kind: str, body: dict[str, Any]):
        """(request id, prompt ids, stream), or an error dict."""
        ids = self._prompt_ids(kind, body)
        rid = f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        stop = body.get("stop") or ()
        sampling = Sampling(
            temperature=float(body.get("temperature") or 0.0),
            top_p=float(body.get("top_p") or 1.0),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
        )
        try:
            stream = self.engine.submit(rid, ids, int(body["max_tokens"]), sampling)
        except EngineRequestError as exc:
            field = "messages" if (exc.field == "prompt" and kind == CHAT) else exc.field
            return openai_error(
                field,
                f"{field}: {exc.message} (got {exc.value!r})"
                if field != "max_tokens"
                else f"max_tokens: {exc.message}",
            )
        self._last_active_s = time.monotonic()
        if self.reporter is not None:
            self.reporter.arrived()
        return rid, ids, stream

    def _finished(self, started_s: float, ok: bool) -> None:
        if self.reporter is not None:
            self.reporter.finished((time.monotonic() - started_s) * 1000.0, ok)

    def _envelope(self, kind: str, rid: str, created: int) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion" if kind == CHAT else "text_completion",
            "created": created,
            "model": self.name,
        }

    async def generate(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """A whole completion: ``{"status": 200, "body": <OpenAI response>}`` or an error dict."""
        await self._ready()
        t0 = time.monotonic()
        got = self._submit(kind, body)
        if isinstance(got, dict):
            return got
        rid, ids, stream = got
        tokens: list[int] = []
        pieces: list[str] = []
        last = TokenDelta(())
        try:
            async for delta in stream:
                tokens.extend(delta.token_ids)
                pieces.append(delta.text)
                last = delta
        finally:
            await stream.aclose()  # a cancelled caller cancels the sequence
        self._finished(t0, last.finish_reason not in FAILED)
        if last.finish_reason is FinishReason.SHED:
            return overloaded(last.error)
        if last.finish_reason is FinishReason.ERROR:
            return server_error(last.error)
        text = "".join(pieces)
        reason = "stop" if last.finish_reason is FinishReason.STOP else "length"
        out = self._envelope(kind, rid, int(time.time()))
        if kind == CHAT:
            out["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}]
        else:
            out["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]
        out["usage"] = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(tokens),
            "total_tokens": len(ids) + len(tokens),
        }
        return {"status": 200, "body": out}

    async def generate_stream(self, kind: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        """First item: ``{"status": 200}`` or an error dict; then SSE strings, ending in ``data: [DONE]``.
        Cancelling the consumer (the client went away) cancels the sequence and frees its blocks."""
        await self._ready()
        t0 = time.monotonic()
        got = self._submit(kind, body)
        if isinstance(got, dict):
            yield got
            return
        rid, _, stream = got
        try:
            first = await anext(stream, None)  # a request shed unstarted gets its 503 before any header
            if first is not None and first.finish_reason is FinishReason.SHED:
                self._finished(t0, False)
                yield overloaded(first.error)
                return
            yield {"status": 200}
            env = dict(
                self._envelope(kind, rid, int(time.time())),
                object="chat.completion.chunk" if kind == CHAT else "text_completion",
            )
            if kind == CHAT:
                yield _sse(dict(env, choices=[{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]))
            async for delta in _after(first, stream):
                text = delta.text
                reason = None
                if delta.finished:
                    reason = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(
                        delta.finish_reason, "error"
                    )
                if not text and reason is None:
                    continue
                if kind == CHAT:
                    choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": reason}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
                yield _sse(dict(env, choices=[choice]))
                if delta.finished:
                    self._finished(t0, delta.finish_reason not in FAILED)
            yield DONE
        finally:
            await stream.aclose()

    # ---------------------------------------------------------------- broker side

    def _engine_report(self) -> dict[str, Any]:
        st = self.engine.stats()
        if st.running or st.waiting:
            self._last_active_s = time.monotonic()
        return engine_report(
            self.engine, 0.0 if (st.running or st.waiting) else time.monotonic() - self._last_active_s, self.name
        )

    async def report(self) -> dict[str, Any]:
        """``engine_report`` of this server's engine, with the bounds the broker set last (status pages)."""
        await self._ready()
        out = self._engine_report()
        if self.reporter is not None:
            out["broker_bounds"] = self.reporter.applied
            out["settings_version"] = self.reporter.settings.version if self.reporter.settings else 0
        return out

    def apply(self, reply: dict[str, Any]) -> dict[str, Any] | None:
        """A broker reply (``ModelSettings`` as a dict) on the running engine: bounds now, the KV
        cache at the next drain. Local: the report loop calls it with each reply."""
        if self.reporter is None:
            raise RuntimeError(f"{self.name}: built without a fleet config, so no broker drives this engine")
        return self.reporter.apply(ModelSettings.from_dict(reply))


def _tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _replica_id(name: str) -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (tests, the benchmark)
        return f"{name}-{uuid.uuid4().hex[:8]}"


def _broker_actor(name: str, namespace: str) -> Any:
    import ray

    return ray.get_actor(name, namespace=namespace)
