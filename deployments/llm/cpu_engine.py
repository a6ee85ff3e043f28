"""The CPU LLM engine: transformers' continuous batching with an admission layer in front.

Design note. transformers 5.24's ``ContinuousBatchingManager`` runs a generation thread that
schedules every step from its own waiting list: decodes first, then prefills (chunked to the
step's token budget), into a paged KV cache of ``num_blocks`` blocks. It cannot honour every
bound the broker sets, at run time:

- ``max_num_seqs``: its ``max_requests_per_batch`` caps the requests *in one step*, not the
  sequences in flight (the rest wait in its list, holding no cap). So the admission layer
  here holds requests in its own FIFO and hands at most ``max_num_seqs`` to the manager;
  lowering it preempts nothing, new admissions wait until enough sequences finish.
- the squeeze (pause new prefills): the admission layer stops handing requests over; the
  ones already handed over keep decoding.
- ``max_batched_tokens``: the step's token budget is the batch processor's
  ``max_batch_tokens``, read at every step; it is lowered live, up to the size the step
  buffers were built for (``max_batched_tokens_max``).
- KV cache size: fixed when the cache is built. A new size is a target; the engine admits
  nothing new, waits for the running sequences to drain, stops the manager, and starts a new
  one with the new ``num_blocks``.

Admission reserves each sequence's worst case (``ceil((prompt + max_tokens) / page)`` blocks)
so the cache cannot run out mid-decode: transformers would then offload (evict and
recompute) a sequence; with the reservation that never happens, and ``preemptions`` stays 0.
The manager's own 15% prefill safety margin is switched off for the same reason, and block
sharing (prefix caching) is off so a finished or cancelled sequence's blocks really free.
Greedy decoding (temperature 0) is deterministic; sampling needs ``do_sample=True``.

All engine state lives on the event loop thread: the manager's thread delivers outputs with
``call_soon_threadsafe``, and the rebuild runs the blocking manager calls in a worker thread.
Call the engine's methods from its event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deployments.llm.engine import (
    GREEDY,
    EngineBounds,
    EngineRequestError,
    EngineStats,
    FinishReason,
    Sampling,
    TokenDelta,
    TokenStream,
)
from deployments.llm.tiny_model import (
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    TinyLlamaSpec,
    build_tiny_llama,
    kv_block_bytes,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuEngineOptions:
    """Options of the CPU engine (the ``options`` of a ``kind: llm`` model)."""

    model: TinyLlamaSpec = field(default_factory=TinyLlamaSpec)
    page_tokens: int = 16  # tokens per KV block
    kv_cache_blocks: int = 64  # cache size at start
    kv_cache_blocks_min: int = 4  # smallest cache set_kv_cache_blocks goes to
    kv_cache_blocks_max: int = 256  # largest cache set_kv_cache_blocks goes to
    max_num_seqs: int = 8  # bound at start
    max_num_seqs_max: int = 64  # largest max_num_seqs (the manager's per-step request cap)
    max_batched_tokens: int = 256  # bound at start
    max_batched_tokens_max: int = 512  # step buffers are built for this many tokens
    do_sample: bool = False  # False: greedy only (temperature 0)
    sample_window: int = 256  # completions kept for the TTFT / TPOT samples

    def __post_init__(self):
        checks = (
            ("page_tokens", self.page_tokens >= 4, "must be at least 4"),
            (
                "kv_cache_blocks_min",
                1 <= self.kv_cache_blocks_min <= self.kv_cache_blocks_max,
                f"must be in [1, kv_cache_blocks_max={self.kv_cache_blocks_max}]",
            ),
            (
                "kv_cache_blocks",
                self.kv_cache_blocks_min <= self.kv_cache_blocks <= self.kv_cache_blocks_max,
                f"must be in [kv_cache_blocks_min={self.kv_cache_blocks_min}, kv_cache_blocks_max={self.kv_cache_blocks_max}]",
            ),
            (
                "max_num_seqs",
                1 <= self.max_num_seqs <= self.max_num_seqs_max,
                f"must be in [1, max_num_seqs_max={self.max_num_seqs_max}]",
            ),
            (
                "max_batched_tokens",
                1 <= self.max_batched_tokens <= self.max_batched_tokens_max,
                f"must be in [1, max_batched_tokens_max={self.max_batched_tokens_max}]",
            ),
            ("sample_window", self.sample_window >= 1, "must be at least 1"),
        )
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {why}")

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(self.model, self.page_tokens)


@dataclass
class _Seq:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stream: TokenStream
    blocks: int  # worst-case KV blocks reserved while it runs
    accepted_s: float
    admitted_s: float = 0.0
    first_s: float | None = None
    last_s: float | None = None
    sent: int = 0  # generated tokens already seen (the manager sends cumulative lists)
    generated: int = 0


@dataclass
class _Counters:
    tokens_in: int = 0
    tokens_out: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    rebuilds: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_ms: deque = field(default_factory=deque)
    tpot_ms: deque = field(default_factory=deque)


class CpuEngine:
    """``LlmEngine`` on transformers' ``ContinuousBatchingManager`` (see the module note)."""

    def __init__(self, options: CpuEngineOptions = CpuEngineOptions(), clock: Callable[[], float] = time.monotonic):
        self.options = options
        self.max_model_len = options.model.max_model_len
        self._clock = clock
        self._model: Any = None
        self._manager: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._bounds = EngineBounds(options.max_num_seqs, options.max_batched_tokens, False)
        self._blocks_total = options.kv_cache_blocks
        self._blocks_target = options.kv_cache_blocks
        self._rebuild_task: asyncio.Task | None = None
        self._stopped = False
        self._c = _Counters(ttft_ms=deque(maxlen=options.sample_window), tpot_ms=deque(maxlen=options.sample_window))

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._model = await asyncio.to_thread(build_tiny_llama, self.options.model)
        self._manager = await asyncio.to_thread(self._build_manager, self._blocks_total)

    async def stop(self) -> None:
        self._stopped = True
        for seq in list(self._waiting):
            self._end(seq, FinishReason.ERROR, "engine stopped before the request was admitted")
        self._waiting.clear()
        if self._rebuild_task is not None:
            await asyncio.gather(self._rebuild_task, return_exceptions=True)
        if self._manager is not None:
            manager, self._manager = self._manager, None
            await asyncio.to_thread(manager.stop, block=True, timeout=10, hard_stop=True)
        for seq in list(self._running.values()):
            self._end(seq, FinishReason.ERROR, "engine stopped")

    def _build_manager(self, num_blocks: int):
        """A started manager with a cache of ``num_blocks`` blocks (blocking; runs in a worker thread)."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        o = self.options
        gen = GenerationConfig(
            do_sample=o.do_sample, max_new_tokens=o.model.max_model_len, eos_token_id=EOS_ID, pad_token_id=PAD_ID
        )
        if o.do_sample:
            gen.temperature, gen.top_p = 0.999, 0.999  # makes transformers build the per-request warpers
        cb = ContinuousBatchingConfig(
            page_size=o.page_tokens,
            num_blocks=num_blocks,
            max_batch_tokens=o.max_batched_tokens_max,
            max_requests_per_batch=o.max_num_seqs_max,
            allow_block_sharing=False,
            use_cuda_graph=False,
            use_async_batching=False,
            safety_margin=0.0,
            scheduler_type="fifo",
            per_request_processors=o.do_sample,
        )
        manager = self._model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()
        deadline = time.monotonic() + 30.0
        while manager.batch_processor is None:  # created by the generation thread
            if time.monotonic() > deadline or not manager.is_running():
                raise RuntimeError("transformers' continuous batching manager did not start its batch processor")
            time.sleep(0.005)
        manager.batch_processor.max_batch_tokens = self._bounds.max_batched_tokens
        return manager

    # ------------------------------------------------------------------ requests

    def blocks_for(self, prompt_len: int, max_tokens: int) -> int:
        return math.ceil((prompt_len + max_tokens) / self.options.page_tokens)

    def submit(
        self, request_id: str, prompt_ids: list[int], max_tokens: int, sampling: Sampling = GREEDY
    ) -> TokenStream:
        self._validate(request_id, prompt_ids, max_tokens, sampling)
        stream = TokenStream(request_id, self.cancel)
        seq = _Seq(
            request_id,
            list(prompt_ids),
            int(max_tokens),
            sampling,
            stream,
            self.blocks_for(len(prompt_ids), max_tokens),
            self._clock(),
        )
        self._waiting.append(seq)
        self._admit()
        return stream

    def _validate(self, request_id: str, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> None:
        if self._stopped or (
            self._manager is None and self._rebuild_task is None
        ):  # a rebuild: it waits, admitted after
            raise EngineRequestError("request_id", request_id, "the engine is not running: start() it first")
        if request_id in self._running or any(s.request_id == request_id for s in self._waiting):
            raise EngineRequestError("request_id", request_id, "already in flight: use a fresh id per request")
        if not prompt_ids:
            raise EngineRequestError("prompt", prompt_ids, "is empty: send at least one token")
        bad = [t for t in prompt_ids if not 0 <= int(t) < VOCAB_SIZE]
        if bad:
            raise EngineRequestError("prompt", bad[:5], f"has token ids outside [0, {VOCAB_SIZE})")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise EngineRequestError("max_tokens", max_tokens, "must be an integer >= 1")
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise EngineRequestError(
                "max_tokens",
                max_tokens,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = {len(prompt_ids) + max_tokens} "
                f"is over the context length {self.max_model_len}: lower max_tokens to at most "
                f"{max(0, self.max_model_len - len(prompt_ids))} or shorten the prompt",
            )
        need = self.blocks_for(len(prompt_ids), max_tokens)
        if need > self.options.kv_cache_blocks_max:
            raise EngineRequestError(
                "max_tokens",
                max_tokens,
                f"needs {need} KV blocks, more than the engine's largest cache ({self.options.kv_cache_blocks_max}): "
                "lower max_tokens or raise kv_cache_blocks_max",
            )
        if sampling.temperature < 0:
            raise EngineRequestError("temperature", sampling.temperature, "must be >= 0 (0 is greedy)")
        if sampling.temperature > 0 and not self.options.do_sample:
            raise EngineRequestError(
                "temperature",
                sampling.temperature,
                "this engine decodes greedily (do_sample: false): send temperature 0",
            )
        if not 0 < sampling.top_p <= 1:
            raise EngineRequestError("top_p", sampling.top_p, "must be in (0, 1]")

    def cancel(self, request_id: str) -> None:
        for seq in self._waiting:
            if seq.request_id == request_id:
                self._waiting.remove(seq)
                self._end(seq, FinishReason.CANCELLED)
                return
        seq = self._running.get(request_id)
        if seq is None:
            return
        manager = self._manager
        if manager is not None:
            manager.cancel_request(request_id)  # its blocks free at the manager's next step
            with manager.output_router._lock:  # a cancelled request never sends a final output
                manager.output_router.result_handlers.pop(request_id, None)
        self._end(seq, FinishReason.CANCELLED)

    def _can_admit(self, seq: _Seq) -> bool:
        if self._bounds.prefill_paused or self._manager is None or self._rebuild_task is not None:
            return False
        if self._blocks_target != self._blocks_total:
            return False  # draining for a rebuild
        if len(self._running) >= self._bounds.max_num_seqs:
            return False
        return self._reserved() + seq.blocks <= self._blocks_total

    def _reserved(self) -> int:
        return sum(s.blocks for s in self._running.values())

    def _admit(self) -> None:
        try:
            running_loop = asyncio.get_running_loop()
        except RuntimeError:
            running_loop = None
        if running_loop is not self._loop and self._loop is not None:
            self._loop.call_soon_threadsafe(self._admit)  # called off the loop: do it there
            return
        while self._waiting and self._can_admit(self._waiting[0]):
            seq = self._waiting.popleft()
            seq.admitted_s = self._clock()
            self._running[seq.request_id] = seq
            self._c.tokens_in += len(seq.prompt_ids)
            self._manager.register_result_handler(seq.request_id, self._on_output)
            kwargs = {}
            if self.options.do_sample:
                kwargs = {"temperature": float(max(seq.sampling.temperature, 1e-5)), "top_p": float(seq.sampling.top_p)}
            rid = self._manager.add_request(
                seq.prompt_ids,
                request_id=seq.request_id,
                max_new_tokens=seq.max_tokens,
                streaming=True,
                eos_token_id=EOS_ID,
                **kwargs,
            )
            if rid is None:
                self._end(seq, FinishReason.ERROR, "the continuous batching manager refused the request (stopped)")

    def _on_output(self, output: Any) -> None:
        """One (cumulative) output from the manager, on the event loop."""
        seq = self._running.get(output.request_id)
        if seq is None:
            return  # cancelled meanwhile
        now = self._clock()
        tokens = list(output.generated_tokens)
        new = tokens[seq.sent :]
        seq.sent = len(tokens)
        if new:
            if seq.first_s is None:
                seq.first_s = now
            seq.last_s = now
            seq.generated += len(new)
            self._c.tokens_out += len(new)
        if output.error is not None:
            self._end(seq, FinishReason.ERROR, str(output.error), new)
            return
        if output.is_finished():
            reason = FinishReason.STOP if tokens and tokens[-1] == EOS_ID else FinishReason.LENGTH
            self._end(seq, reason, None, new)
            return
        if new:
            seq.stream.put(TokenDelta(tuple(t for t in new if t != EOS_ID)))

    def _end(self, seq: _Seq, reason: FinishReason, error: str | None = None, new: list[int] | None = None) -> None:
        was_running = self._running.pop(seq.request_id, None) is not None
        c = self._c
        if reason is FinishReason.CANCELLED:
            c.cancelled += 1
        elif reason is FinishReason.ERROR:
            c.failed += 1
        else:
            c.finished += 1
            if seq.first_s is not None:
                c.ttft_ms.append((seq.first_s - seq.accepted_s) * 1000.0)
                c.prefill_s += max(0.0, seq.first_s - seq.admitted_s)
                c.decode_s += max(0.0, seq.last_s - seq.first_s)
                if seq.generated > 1:
                    c.tpot_ms.append((seq.last_s - seq.first_s) * 1000.0 / (seq.generated - 1))
        seq.stream.put(TokenDelta(tuple(t for t in (new or []) if t != EOS_ID), True, reason, error))
        if was_running and not self._stopped:
            self._admit()
            self._maybe_rebuild()

    # ------------------------------------------------------------------ bounds and cache

    def set_bounds(self, max_num_seqs: int, max_batched_tokens: int, prefill_paused: bool = False) -> EngineBounds:
        o = self.options
        self._bounds = EngineBounds(
            max(1, min(int(max_num_seqs), o.max_num_seqs_max)),
            max(1, min(int(max_batched_tokens), o.max_batched_tokens_max)),
            bool(prefill_paused),
        )
        manager = self._manager
        if manager is not None and manager.batch_processor is not None:
            manager.batch_processor.max_batch_tokens = self._bounds.max_batched_tokens  # read at every step
        self._admit()
        return self._bounds

    @property
    def bounds(self) -> EngineBounds:
        return self._bounds

    def set_kv_cache_blocks(self, num_blocks: int) -> int:
        o = self.options
        self._blocks_target = max(o.kv_cache_blocks_min, min(int(num_blocks), o.kv_cache_blocks_max))
        self._maybe_rebuild()
        return self._blocks_target

    def _maybe_rebuild(self) -> None:
        if self._blocks_target == self._blocks_total or self._running or self._rebuild_task is not None:
            return
        if self._stopped or self._manager is None or self._loop is None:
            return
        self._rebuild_task = self._loop.create_task(self._rebuild(self._blocks_target))

    async def _rebuild(self, num_blocks: int) -> None:
        try:
            old, self._manager = self._manager, None
            await asyncio.to_thread(old.stop, block=True, timeout=10)
            if self._stopped:
                return
            try:
                self._manager = await asyncio.to_thread(self._build_manager, num_blocks)
            except Exception:
                logger.exception("KV cache rebuild to %d blocks failed; rebuilding %d", num_blocks, self._blocks_total)
                self._blocks_target = self._blocks_total
                self._manager = await asyncio.to_thread(self._build_manager, self._blocks_total)
            else:
                self._blocks_total = num_blocks
                self._c.rebuilds += 1
        finally:
            self._rebuild_task = None
        self._admit()
        self._maybe_rebuild()  # the target may have moved while this one was built

    async def wait_rebuilt(self) -> None:
        """Until no rebuild is pending or running (tests and the API's drain use it)."""
        while self._rebuild_task is not None or (self._blocks_target != self._blocks_total and not self._running):
            if self._rebuild_task is not None:
                await asyncio.shield(self._rebuild_task)
            else:
                await asyncio.sleep(0.01)

    def kv_cache_bytes(self) -> int:
        # the cache tensor holds two spare ("trash") blocks besides the usable ones
        return (self._blocks_total + 2) * self.options.block_bytes

    def stats(self) -> EngineStats:
        used = 0
        manager = self._manager
        bp = manager.batch_processor if manager is not None else None
        if bp is not None:
            used = self._blocks_total - round(bp.cache.compute_free_capacity() * self._blocks_total)
        c, b = self._c, self._bounds
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            max_num_seqs=b.max_num_seqs,
            max_batched_tokens=b.max_batched_tokens,
            prefill_paused=b.prefill_paused,
            kv_blocks_total=self._blocks_total,
            kv_blocks_used=max(0, used),
            kv_blocks_reserved=self._reserved(),
            kv_blocks_target=self._blocks_target,
            kv_block_tokens=self.options.page_tokens,
            kv_block_bytes=self.options.block_bytes,
            preemptions=0,
            tokens_in=c.tokens_in,
            tokens_out=c.tokens_out,
            finished=c.finished,
            cancelled=c.cancelled,
            failed=c.failed,
            rebuilds=c.rebuilds,
            prefill_s=c.prefill_s,
            decode_s=c.decode_s,
            ttft_ms=tuple(c.ttft_ms),
            tpot_ms=tuple(c.tpot_ms),
        )
