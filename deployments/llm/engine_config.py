"""A ``kind: llm`` model's config as the engine's options: vLLM's names in, ``VllmEngineOptions`` out.

``engine_kwargs`` are vLLM's engine arguments as the user wrote them; they pass through to vLLM
(``vllm_engine.vllm_kwargs``) except the ones the broker moves and accounts for, which become the
engine's bounds (``gpubroker.quotas.llm_spec.BROKER_MOVED`` says what each value means):

| vLLM argument | under gpubroker |
| --- | --- |
| ``max_num_seqs`` | vLLM's scheduler bound as written; the admission bound moves in [1, it], from half ``llm.expected_peak_concurrency`` |
| ``max_num_batched_tokens`` | the step at start and the largest; the broker lowers it and raises it back |
| ``num_gpu_blocks_override`` | the cache at start; it moves in [``options.kv_cache_blocks_min``, ``options.kv_cache_blocks_max``] |
| ``block_size``, ``max_model_len`` | as written; unset: 128 on CPU and 16 on CUDA (vLLM's), the model's context (512 for tiny-llama) |

``options`` keep gpubroker's own words; the old renamed ones are still read for one release, each
with a warning in the log (``gpubroker validate`` prints the same).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from gpubroker.deployments.llm.model_source import context_length, resolve_model
from gpubroker.deployments.llm.tiny_model import DEFAULT_DIR, TinyLlamaSpec, ensure_tiny_llama
from gpubroker.deployments.llm.vllm_engine import VllmEngineOptions
from gpubroker.quotas.llm_spec import (
    DEPRECATED_OPTIONS,
    ENGINE_OPTIONS,
    TINY_MODEL_OPTIONS,
    LlmSpec,
    check_engine_keys,
    deprecated_options,
)

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = {"cpu": 128, "cuda": 16}  # vLLM's own: its CPU build's, and CUDA's
TINY_CONTEXT = 512  # the built-in tiny-llama's context (its config allows 2048)
DEFAULT_SEQS_MAX = 64  # max_num_seqs unset: the admission's ceiling
DEFAULT_STEP, DEFAULT_STEP_MAX = 512, 2048  # max_num_batched_tokens unset: start and largest step
DEFAULT_BLOCKS, DEFAULT_BLOCKS_MAX = 8, 64  # num_gpu_blocks_override / kv_cache_blocks_max unset
# vLLM's names read from an old option one to one (two old keys make max_num_batched_tokens: start, largest)
OLD_FOR = {
    r.new.partition(".")[2]: old
    for old, r in DEPRECATED_OPTIONS.items()
    if r.new.startswith("engine_kwargs.") and r.new != "engine_kwargs.max_num_batched_tokens"
}
# the engine's option names as the user writes them, for the engine's refusals
USER_NAMES = {
    "kv_cache_blocks_min": "options.kv_cache_blocks_min",
    "kv_cache_blocks_max": "options.kv_cache_blocks_max",
    "kv_cache_blocks": "engine_kwargs.num_gpu_blocks_override",
    "block_tokens": "engine_kwargs.block_size",
    "max_model_len": "engine_kwargs.max_model_len",
    "max_num_seqs_max": "engine_kwargs.max_num_seqs",
    "max_num_seqs": "the admission bound at start",
    "max_batched_tokens_max": "engine_kwargs.max_num_batched_tokens",
    "max_batched_tokens": "engine_kwargs.max_num_batched_tokens",
    "gpu_memory_utilization": "engine_kwargs.gpu_memory_utilization",
}


def engine_options(
    options: dict[str, Any],
    engine_kwargs: dict[str, Any] | None = None,
    model: str = "tiny-llama",
    llm: LlmSpec | None = None,
    fleet_device: str = "cpu",
    build: bool = True,
) -> VllmEngineOptions:
    """The engine's options for a ``kind: llm`` model (its ``model``, ``engine_kwargs``, ``options``
    and ``llm`` objectives). Refuses what the schema refuses, a model that is not on disk
    (``ModelNotFound``) and bounds that do not fit together (``ValueError`` naming the key as
    written). ``build=False`` (validate): the built-in tiny-llama is not built."""
    kwargs = dict(engine_kwargs or {})
    check_engine_keys(model, options, kwargs)
    if build:
        for message in deprecated_options(options):
            logger.warning("%s", message)
    model_dir = _model_dir(model, options, kwargs.get("revision"), build)
    device = str(options.get("device") or ("cuda" if fleet_device.startswith("cuda") else "cpu"))
    context = _first(kwargs, options, "max_model_len") or _default_context(model, model_dir)
    block = _first(kwargs, options, "block_size") or DEFAULT_BLOCK_SIZE.get(device, 16)
    seqs_max = _first(kwargs, options, "max_num_seqs") or DEFAULT_SEQS_MAX
    peak = (llm or LlmSpec()).expected_peak_concurrency
    step = _first(kwargs, options, "max_num_batched_tokens")
    blocks_min = options.get("kv_cache_blocks_min") or -(-context // block) + 1
    blocks = _first(kwargs, options, "num_gpu_blocks_override") or max(DEFAULT_BLOCKS, blocks_min)
    own = {k: v for k, v in options.items() if k in ENGINE_OPTIONS and not k.startswith("kv_cache_blocks_")}
    if "enable_sleep_mode" in kwargs:
        own.setdefault("sleep_when_idle", bool(kwargs["enable_sleep_mode"]))
    own["device"] = device
    try:
        return VllmEngineOptions(
            model_dir=str(model_dir),
            max_model_len=context,
            block_tokens=block,
            kv_cache_blocks=blocks,
            kv_cache_blocks_min=blocks_min,
            kv_cache_blocks_max=options.get("kv_cache_blocks_max") or max(DEFAULT_BLOCKS_MAX, blocks),
            max_num_seqs=options.get("max_num_seqs") or min(seqs_max, max(1, peak // 2)),
            max_num_seqs_max=seqs_max,
            max_batched_tokens=options.get("max_batched_tokens") or step or max(DEFAULT_STEP, context),
            max_batched_tokens_max=options.get("max_batched_tokens_max") or step or max(DEFAULT_STEP_MAX, context),
            enable_prefix_caching=_first(kwargs, options, "enable_prefix_caching"),
            gpu_memory_utilization=_first(kwargs, options, "gpu_memory_utilization") or 0.0,
            engine_kwargs=kwargs,
            **own,
        )
    except (TypeError, ValueError) as exc:  # the engine's own checks, in the names the user wrote
        raise ValueError(re.sub(r"\b(\w+)(?==)", lambda m: USER_NAMES.get(m[1], m[1]), str(exc))) from None


def _first(kwargs: dict[str, Any], options: dict[str, Any], vllm_name: str) -> Any:
    """The value of vLLM's ``vllm_name``: from engine_kwargs, else from the old option mapped to it
    one to one (the two at once are refused by ``check_engine_keys``)."""
    if vllm_name in kwargs:
        return kwargs[vllm_name]
    return options.get(OLD_FOR.get(vllm_name, ""))


def _model_dir(model: str, options: dict[str, Any], revision: str | None, build: bool) -> Path:
    """The model's local directory: the built-in tiny-llama (built once under ``build/`` from its shape
    options), the old ``options.model_dir``, a directory, or a model id in the Hugging Face cache."""
    if options.get("model_dir"):
        return resolve_model(str(options["model_dir"]))
    if model != "tiny-llama":
        return resolve_model(model, revision=revision)
    spec = TinyLlamaSpec(**{k: v for k, v in options.items() if k in TINY_MODEL_OPTIONS})
    where = DEFAULT_DIR if spec == TinyLlamaSpec() else DEFAULT_DIR.with_name(f"tiny-llama-{spec.digest()}")
    return ensure_tiny_llama(where, spec) if build else where


def _default_context(model: str, model_dir: Path) -> int:
    """vLLM's default max_model_len, the model's own context; tiny-llama's is ``TINY_CONTEXT``."""
    if (model == "tiny-llama" and not model_dir.is_dir()) or (model_dir / "gpubroker-spec.json").is_file():
        return TINY_CONTEXT
    found = context_length(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    if found is None:
        raise ValueError(f"engine_kwargs.max_model_len: {model_dir}/config.json gives no context length; set it")
    return found
