"""The LLM engine protocol: what the broker and the OpenAI API need from a continuous-batching engine.

A continuous-batching engine batches every step, so nobody hands it a batch. What can be set
from outside are its bounds: how many sequences run at once (``max_num_seqs``), how many
tokens one step may process (``max_batched_tokens``), whether new prefills are admitted (the
squeeze), and how big its paged KV cache is (``set_kv_cache_blocks``). The broker sets those;
the API submits requests and reads token streams.

The implementation is ``gpubroker.deployments.llm.vllm_engine.VllmEngine`` (vLLM, its CPU
build here and its CUDA build on GPUs); a test double may implement it too.

Nothing here imports torch: the protocol, its value types and the errors are plain Python.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable


class EngineRequestError(ValueError):
    """A request the engine refuses before it starts; the API answers 400 naming ``field``."""

    def __init__(self, field: str, value: object, message: str, over_context: bool = False):
        self.field = field  # the request field at fault: prompt, max_tokens, temperature, request_id
        self.value = value  # the bad value as sent
        self.message = message  # what is wrong and how to fix it
        self.over_context = over_context  # prompt + max_tokens over the context length
        super().__init__(f"{field}={value!r}: {message}")


class EngineError(RuntimeError):
    """The engine failed a request after it started (the model raised, or the engine stopped)."""


class FinishReason(StrEnum):
    STOP = "stop"  # the model produced an end-of-sequence token
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # cancel() or the stream was closed
    ERROR = "error"  # the engine failed the request
    SHED = "shed"  # refused unstarted: it waited for admission past max_queue_wait_ms (overload)


@dataclass(frozen=True)
class Sampling:
    """How tokens are picked, by vLLM's ``SamplingParams`` names. ``temperature`` 0 is greedy
    (deterministic) decoding; above it, a ``seed`` makes the draw repeatable."""

    temperature: float = 0.0
    top_p: float = 1.0  # nucleus sampling mass; 1.0 keeps every token
    stop: tuple[str, ...] = ()  # strings that end the generation (not included in the text)
    seed: int | None = None  # the request's own random seed (None: unseeded)
    logprobs: int | None = None  # per generated token, its log-probability and the top N others (None: none)
    presence_penalty: float = 0.0  # in [-2, 2]: penalise tokens already in the text
    frequency_penalty: float = 0.0  # in [-2, 2]: penalise tokens by how often they appear


GREEDY = Sampling()


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely tokens at its place (vLLM's
    ``Logprob`` entries, when the request asked for ``logprobs``)."""

    token_id: int
    token: str  # the token's text (vLLM's decoded_token; "" for a piece of a multi-byte character)
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # the ``logprobs`` most likely (token, logprob), likeliest first


@dataclass(frozen=True)
class TokenDelta:
    """One piece of a token stream: the tokens generated since the previous piece."""

    token_ids: tuple[int, ...]  # new tokens, in order (may be empty on the final piece)
    finished: bool = False  # True on the last piece of the stream
    finish_reason: FinishReason | None = None  # set on the last piece
    error: str | None = None  # set when finish_reason is ERROR
    text: str = ""  # the detokenized text of token_ids (the engine's detokenizer; stop strings cut out)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of token_ids when the request asked for them


@dataclass(frozen=True)
class EngineBounds:
    """The bounds an engine runs with now (what ``set_bounds`` asked for, as clamped)."""

    max_num_seqs: int  # sequences admitted at once (running, prefilling or decoding)
    max_batched_tokens: int  # tokens one step may process (prefill chunks + decodes)
    prefill_paused: bool  # True: no new sequence is admitted; running ones keep decoding


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine. Counters are cumulative since start; samples are the most
    recent completions (a sliding window of ``sample_window`` requests)."""

    running: int  # sequences admitted to the engine and not finished
    waiting: int  # sequences accepted but held by the admission layer
    max_num_seqs: int  # bound in force
    max_batched_tokens: int  # bound in force
    prefill_paused: bool  # squeeze in force
    kv_blocks_total: int  # blocks in the KV cache now
    kv_blocks_used: int  # blocks holding KV entries now (read from the cache)
    kv_blocks_reserved: int  # blocks the admission layer reserved (worst case of running sequences)
    kv_blocks_target: int  # cache size asked for; differs from total until the next rebuild
    kv_block_tokens: int  # tokens per block (page size)
    kv_block_bytes: int  # bytes per block (all layers, K and V)
    preemptions: int  # sequences evicted from the cache and recomputed
    tokens_in: int  # prompt tokens of admitted sequences
    tokens_out: int  # tokens generated
    finished: int  # sequences that ended with stop or length
    cancelled: int  # sequences cancelled
    failed: int  # sequences the engine failed
    rebuilds: int  # KV cache resizes (engine restarts between drains)
    prefill_s: float  # sequence-seconds from admission to first token (the prefill share)
    decode_s: float  # sequence-seconds from first to last token (the decode share)
    ttft_ms: tuple[float, ...]  # time to first token (accept -> first token), recent completions
    tpot_ms: tuple[float, ...]  # time per output token after the first, recent completions
    engine_running: int = 0  # sequences the engine's own scheduler runs (vLLM's SchedulerStats)
    engine_waiting: int = 0  # sequences the engine's own scheduler holds waiting (after admission)
    kv_usage_frac: float = 0.0  # the engine's KV cache usage, 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of them, found in the cache (cumulative)
    shed: int = 0  # sequences refused unstarted after waiting past max_queue_wait_ms (cumulative)
    last_restart_s: float = 0.0  # the last KV resize's shutdown + start, in seconds
    restart_s_total: float = 0.0  # every KV resize's shutdown + start, summed
    seq_tokens_mean: float = (
        0.0  # tokens a sequence holds in the cache over its life (prompt + half its output), recent mean
    )
    asleep: bool = False  # the engine sleeps (CUDA sleep mode level 1: KV cache freed)

    @property
    def kv_blocks_free(self) -> int:
        return max(0, self.kv_blocks_total - self.kv_blocks_used)

    @property
    def prefill_time_frac(self) -> float:
        """Share of sequence-time spent before the first token (0 when nothing ran yet)."""
        total = self.prefill_s + self.decode_s
        return self.prefill_s / total if total > 0 else 0.0


def percentile(samples: tuple[float, ...] | list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None without samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


@runtime_checkable
class LlmEngine(Protocol):
    """A continuous-batching generation engine under the broker."""

    max_model_len: int  # context length: prompt tokens + max_tokens must fit

    async def start(self) -> None:
        """Build the model and the cache, start stepping. Call once, from the event loop."""

    async def stop(self) -> None:
        """Fail what is left and stop stepping."""

    def submit(
        self, request_id: str, prompt_ids: list[int], max_tokens: int, sampling: Sampling = GREEDY
    ) -> AsyncIterator[TokenDelta]:
        """Accept a request and return its token stream. Refuses a bad request at once with
        ``EngineRequestError`` (before any token); closing the stream early cancels it."""

    def cancel(self, request_id: str) -> None:
        """Stop a request (waiting or running) and free its KV blocks; unknown ids are ignored."""

    def set_bounds(self, max_num_seqs: int, max_batched_tokens: int, prefill_paused: bool = False) -> EngineBounds:
        """Set the bounds; returns them as applied (clamped to what the engine was built for).
        Lowering ``max_num_seqs`` under the running count preempts nothing: new admissions wait."""

    def set_kv_cache_blocks(self, num_blocks: int) -> int:
        """Ask for a cache of ``num_blocks`` blocks; returns the target as clamped. The engine
        restarts with the new cache at the next drain (no sequence running) and admits nothing
        new until then (on CUDA the smallest cache may be sleep mode instead)."""

    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds now (what counts against the model's grant)."""

    def stats(self) -> EngineStats:
        """A snapshot of the engine (see ``EngineStats``)."""


class TokenStream:
    """An async iterator of ``TokenDelta`` fed from the engine's side with ``put``.

    ``put`` must be called on the stream's event loop. Leaving the iteration early (break,
    ``aclose()``, the consumer cancelled) calls ``on_close`` once, which cancels the request.
    """

    def __init__(self, request_id: str, on_close):
        self.request_id = request_id
        self._queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._on_close = on_close
        self._done = False  # the final piece went out to the consumer
        self._closed = False

    def put(self, delta: TokenDelta) -> None:
        self._queue.put_nowait(delta)

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._done or self._closed:
            raise StopAsyncIteration
        try:
            delta = await self._queue.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if delta.finished:
            self._done = True
        return delta

    async def aclose(self) -> None:
        if not self._done and not self._closed:
            self._closed = True
            self._on_close(self.request_id)
        self._closed = True

    async def collect(self) -> tuple[list[int], TokenDelta]:
        """All tokens until the end, and the final piece (for non-streaming callers)."""
        tokens: list[int] = []
        last = TokenDelta(())
        async for delta in self:
            tokens.extend(delta.token_ids)
            last = delta
        return tokens, last
