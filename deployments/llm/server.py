"""The Serve deployment that hosts one LLM engine: generation, token streams, bounds, stats.

``LlmServer`` owns the engine and its tokenizer. The OpenAI ingress (``openai_api``) sends it
validated request bodies; it tokenises, submits, and returns OpenAI-shaped bodies, or, for
``stream: true``, yields the server-sent events (shaped by ``openai_bodies``). A request with
``n`` choices is ``n`` sequences in the engine, as vLLM runs ``n`` (each admitted and counted in the
KV cache as one; a ``seed`` gives choice ``i`` the seed ``seed + i``). A request the engine refuses
comes back as ``{"status": 400, "body": <OpenAI error naming the field>, "headers": {}}``
(``gpubroker.deployments.serve.openai_errors``; the stream's first item says the same), so the
ingress can answer before any event is sent; one it shed for overload is a 503 with ``Retry-After``.

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
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from gpubroker.broker.wire import EngineReport, ModelSettings
from gpubroker.deployments.llm.engine import (
    EngineRequestError,
    FinishReason,
    Sampling,
    TokenDelta,
    percentile,
)
from gpubroker.deployments.llm.engine_config import engine_options
from gpubroker.deployments.llm.openai_bodies import (
    CHAT,
    Choice,
    chunk_choice,
    role_choice,
    usage,
    whole_choices,
)
from gpubroker.deployments.llm.report_loop import EngineReporter, engine_link
from gpubroker.deployments.llm.vllm_engine import VllmEngine
from gpubroker.deployments.serve.openai_errors import invalid, overloaded, server_error

if TYPE_CHECKING:
    from gpubroker.quotas.config import FleetConfig


@dataclass(frozen=True)
class Submitted:
    """A request in the engine: its id, its prompt's tokens, one token stream per choice."""

    request_id: str
    prompt_tokens: int
    streams: list[AsyncIterator[TokenDelta]]


async def _gathered(stream: AsyncIterator[TokenDelta]) -> Choice:
    """One choice's stream read to its end (closing it early, cancelled, cancels its sequence)."""
    choice = Choice()
    try:
        async for delta in stream:
            choice.add(delta)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]  # TokenStream
    return choice


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
FAILED = (FinishReason.ERROR, FinishReason.SHED)  # ends that count as a failed request, not a completion
OVERLOAD_RETRY_AFTER_S = 1  # Retry-After on a shed request: the engine's queue moves in well under a second


def refusal(kind: str, body: dict[str, Any], exc: EngineRequestError) -> dict[str, Any]:
    """A request the engine refused, as OpenAI's 400 naming the field the client sent."""
    field = exc.field
    if field == "prompt" and kind == CHAT:
        field = "messages"
    elif field == "max_tokens":
        field = str(body.get("max_tokens_param") or "max_tokens")
    if exc.over_context:
        return invalid(field, f"{field}: {exc.message}", "context_length_exceeded").reply()
    return invalid(field, f"{field}: {exc.message} (got {exc.value!r})").reply()


def sampling_for(body: dict[str, Any]) -> Sampling:
    """A parsed body's sampling, by vLLM's ``SamplingParams`` names (``openai_api.parse_body``
    filled ``logprobs`` with the number of top logprobs per token, or None)."""
    stop = body.get("stop") or ()
    return Sampling(
        temperature=float(body.get("temperature") or 0.0),
        top_p=float(body.get("top_p") or 1.0),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        seed=body.get("seed"),
        logprobs=body.get("logprobs"),
        presence_penalty=float(body.get("presence_penalty") or 0.0),
        frequency_penalty=float(body.get("frequency_penalty") or 0.0),
    )


def choice_sampling(base: Sampling, index: int) -> Sampling:
    """Choice ``index`` of a request with ``n`` choices: vLLM's own rule for ``n`` (its
    ``ParentRequest`` gives child ``i`` the seed ``seed + i``), so each choice differs and a
    seeded request repeats whole."""
    return base if base.seed is None or index == 0 else replace(base, seed=base.seed + index)


async def _after(first: TokenDelta | None, rest: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
    """``first`` (already taken from the stream), then the rest of the stream."""
    if first is None:
        return
    yield first
    if not first.finished:
        async for delta in rest:
            yield delta


async def merged(streams: list[AsyncIterator[TokenDelta]]) -> AsyncIterator[tuple[int, TokenDelta]]:
    """The pieces of several streams as they come, each with its stream's index (the ``n``
    choices of one request); leaving early stops reading every stream."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, TokenDelta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[TokenDelta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, raised there
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def engine_report(engine: VllmEngine, idle_for_s: float, name: str = "") -> EngineReport:
    """Engine stats as the wire carries them: the ``EngineStats`` counters and bounds, TTFT/TPOT
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
    return EngineReport(**out)


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

    def _submit(self, kind: str, body: dict[str, Any]) -> Submitted | dict[str, Any]:
        """The request's ``n`` sequences submitted (one per choice), or an error dict (none submitted)."""
        ids = self._prompt_ids(kind, body)
        rid = f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        n, base = int(body.get("n") or 1), sampling_for(body)
        streams: list[AsyncIterator[TokenDelta]] = []
        try:
            for i in range(n):
                seq_id = rid if n == 1 else f"{rid}-{i}"
                streams.append(self.engine.submit(seq_id, ids, int(body["max_tokens"]), choice_sampling(base, i)))
        except EngineRequestError as exc:
            for i in range(len(streams)):
                self.engine.cancel(rid if n == 1 else f"{rid}-{i}")
            return refusal(kind, body, exc)
        self._last_active_s = time.monotonic()
        if self.reporter is not None:
            self.reporter.arrived()
        return Submitted(rid, len(ids), streams)

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
        choices = await asyncio.gather(*(_gathered(s) for s in got.streams))
        ends = [c.last.finish_reason for c in choices]
        self._finished(t0, not any(e in FAILED for e in ends))
        failed = next((c.last for c in choices if c.last.finish_reason in FAILED), None)
        if failed is not None and failed.finish_reason is FinishReason.SHED:
            return overloaded(failed.error or "the engine is overloaded", OVERLOAD_RETRY_AFTER_S).reply()
        if failed is not None:
            return server_error(failed.error or "the engine failed the request").reply()
        out = self._envelope(kind, got.request_id, int(time.time()))
        out["choices"] = whole_choices(kind, choices, body.get("logprobs") is not None)
        out["usage"] = usage(got.prompt_tokens, sum(len(c.tokens) for c in choices))
        return {"status": 200, "body": out}

    async def generate_stream(self, kind: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        """First item: ``{"status": 200}`` or an error dict; then SSE strings, ending in ``data: [DONE]``
        (with ``stream_options.include_usage``, a last chunk with the usage and no choices before it).
        Cancelling the consumer (the client went away) cancels the sequences and frees their blocks."""
        await self._ready()
        t0 = time.monotonic()
        got = self._submit(kind, body)
        if isinstance(got, dict):
            yield got
            return
        try:
            # a request shed unstarted gets its 503 before any header
            firsts = [await anext(s, None) for s in got.streams]
            shed = next((f for f in firsts if f is not None and f.finish_reason is FinishReason.SHED), None)
            if shed is not None:
                self._finished(t0, False)
                yield overloaded(shed.error or "the engine is overloaded", OVERLOAD_RETRY_AFTER_S).reply()
                return
            yield {"status": 200}
            async for event in self._events(kind, body, got, firsts, t0):
                yield event
            yield DONE
        finally:
            for stream in got.streams:
                await stream.aclose()  # type: ignore[attr-defined]  # TokenStream: cancels an unfinished sequence

    async def _events(
        self, kind: str, body: dict[str, Any], got: Submitted, firsts: list[TokenDelta | None], t0: float
    ) -> AsyncIterator[str]:
        """The SSE chunks of a stream whose first pieces are ``firsts``."""
        env = dict(
            self._envelope(kind, got.request_id, int(time.time())),
            object="chat.completion.chunk" if kind == CHAT else "text_completion",
        )
        with_usage = bool(body.get("include_usage"))
        if with_usage:
            env["usage"] = None  # OpenAI's every chunk but the last
        want_logprobs = body.get("logprobs") is not None
        if kind == CHAT:
            for i in range(len(got.streams)):
                yield _sse(dict(env, choices=[role_choice(i)]))
        offsets, generated, ends = [0] * len(firsts), 0, []
        async for i, delta in merged([_after(f, s) for f, s in zip(firsts, got.streams)]):
            generated += len(delta.token_ids)
            choice = chunk_choice(kind, i, delta, want_logprobs, offsets[i])
            offsets[i] += sum(len(e.token) for e in delta.logprobs)
            if delta.finished:
                ends.append(delta.finish_reason)
            if choice is not None:
                yield _sse(dict(env, choices=[choice]))
        self._finished(t0, len(ends) == len(firsts) and not any(e in FAILED for e in ends))
        if with_usage:
            yield _sse(dict(env, choices=[], usage=usage(got.prompt_tokens, generated)))

    # ---------------------------------------------------------------- broker side

    def _engine_report(self) -> EngineReport:
        st = self.engine.stats()
        if st.running or st.waiting:
            self._last_active_s = time.monotonic()
        return engine_report(
            self.engine, 0.0 if (st.running or st.waiting) else time.monotonic() - self._last_active_s, self.name
        )

    async def report(self) -> dict[str, Any]:
        """``engine_report`` of this server's engine, with the bounds the broker set last (status pages)."""
        await self._ready()
        out = self._engine_report().to_dict()
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
