"""A ``kind: llm`` model's sections: the objectives the LLM rules steer by (``llm:``), and the words
its engine is configured in.

An LLM user already has vLLM's engine arguments; a ``kind: llm`` model takes them as they are under
``engine_kwargs:`` (passed through to vLLM; ``gpubroker validate`` checks the names against the
installed vLLM, ``gpubroker.validate``). ``options:`` keeps only what vLLM has no word for: the
broker's bounds on what it moves (``ENGINE_OPTIONS``). Three of vLLM's arguments the broker moves
at run time; the user's value is a bound or a start (``BROKER_MOVED``). The keys gpubroker used to
rename (``block_tokens`` for ``block_size``...) still work for one release (``DEPRECATED_OPTIONS``).

Pure: no vLLM import, no file system (the model's directory or cache entry is checked by
``gpubroker validate`` and by the engine).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gpubroker.quotas.config_errors import did_you_mean

LLM_ENGINES = ("tiny-llama",)  # built-in kind: llm models (gpubroker.deployments.llm.tiny_model)

# vLLM's engine arguments the broker moves at run time, and what the user's value means under it
BROKER_MOVED: dict[str, str] = {
    "max_num_seqs": "the largest: vLLM's scheduler gets it as written and the broker admits at most this many "
    "sequences at once, starting at half llm.expected_peak_concurrency (default 64)",
    "max_num_batched_tokens": "the largest step: vLLM starts with it; the broker lowers it when prefill "
    "dominates and raises it back, never above it (default 512, at least max_model_len)",
    "num_gpu_blocks_override": "the KV cache at start, in blocks; the broker resizes it inside the model's "
    "grant within options.kv_cache_blocks_min..kv_cache_blocks_max (default 8)",
}
# vLLM's engine arguments the broker sets itself: refused in engine_kwargs, with where to write them
BROKER_SET: dict[str, str] = {
    "model": "write the model as the model's model: (a local Hugging Face directory, a model id in the local "
    "Hugging Face cache, or tiny-llama)",
}

# gpubroker's own options of a kind: llm model (what vLLM has no word for)
ENGINE_OPTIONS: dict[str, str] = {
    "kv_cache_blocks_min": "smallest KV cache the broker shrinks to, in blocks (default: one whole context "
    "plus vLLM's null block)",
    "kv_cache_blocks_max": "largest KV cache the broker grows to, in blocks (default 64, at least the start)",
    "device": "cpu or cuda (default: cuda where the fleet's gpu.device is cuda, else cpu)",
    "sleep_when_idle": "cuda: the smallest cache is vLLM's sleep mode level 1 instead of a restart (default true)",
    "in_process": "vLLM stepped in the replica's process (fast restarts; default: on cpu only)",
    "max_queue_wait_ms": "a request waiting for admission longer than this is shed with a 503 (default 0: never)",
    "sample_window": "completions kept for the TTFT / TPOT percentiles (default 256)",
    "vocab_size": "token ids a prompt may use (default 0: the model's config.json)",
}
# the built-in tiny-llama's shape (gpubroker.deployments.llm.tiny_model.TinyLlamaSpec)
TINY_MODEL_OPTIONS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "seed")


@dataclass(frozen=True)
class Renamed:
    """An option gpubroker renamed or moved: still read for one release, with a warning."""

    old: str  # the options key as it was
    new: str  # where it goes now: engine_kwargs.<vLLM's name>, or model
    note: str = ""  # how the old value maps, where it is not one to one


DEPRECATED_OPTIONS: dict[str, Renamed] = {
    r.old: r
    for r in (
        Renamed("block_tokens", "engine_kwargs.block_size"),
        Renamed("kv_cache_blocks", "engine_kwargs.num_gpu_blocks_override"),
        Renamed("max_model_len", "engine_kwargs.max_model_len"),
        Renamed("max_num_seqs_max", "engine_kwargs.max_num_seqs", "vLLM's max_num_seqs is the largest"),
        Renamed(
            "max_num_seqs",
            "llm.expected_peak_concurrency",
            "the admission bound at start; the broker starts at half the expected peak, and "
            "engine_kwargs.max_num_seqs is the largest",
        ),
        Renamed("max_batched_tokens", "engine_kwargs.max_num_batched_tokens", "the step at start"),
        Renamed("max_batched_tokens_max", "engine_kwargs.max_num_batched_tokens", "the largest step"),
        Renamed("enable_prefix_caching", "engine_kwargs.enable_prefix_caching"),
        Renamed("gpu_memory_utilization", "engine_kwargs.gpu_memory_utilization"),
        Renamed("model_dir", "model", "write the directory as the model's model:"),
    )
}

_INT_MOVED = ("max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override", "block_size", "max_model_len")


class LlmSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    expected_peak_concurrency: int = Field(
        8,
        ge=1,
        le=4096,
        description="Sequences in flight at the expected peak; max_num_seqs starts at half of it, within memory.",
    )
    ttft_slo_ms: float = Field(
        2000.0, gt=0, le=600_000, description="Time-to-first-token P95 objective in milliseconds."
    )
    tpot_slo_ms: float = Field(
        200.0, gt=0, le=60_000, description="Time-per-output-token P95 objective in milliseconds."
    )


def is_llm_model_ref(value: str) -> bool:
    """A built-in LLM, a directory path or a Hugging Face model id (``org/name`` or ``name``)."""
    if value in LLM_ENGINES or value.startswith(("/", "./", "../", "~")):
        return True
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)*", value) is not None


def check_engine_keys(model: str, options: Mapping[str, Any], engine_kwargs: Mapping[str, Any]) -> None:
    """Refuse, naming the field, an option gpubroker does not know, a tiny-model option on another
    model, an argument the broker sets, an old key written beside its new one, and a bad value of an
    argument the broker moves. vLLM's own names are checked against the installed vLLM by validate."""
    for key in options:
        if key in ENGINE_OPTIONS or key in DEPRECATED_OPTIONS:
            continue
        if key in TINY_MODEL_OPTIONS:
            if model != "tiny-llama" or options.get("model_dir"):
                raise ValueError(f"options.{key}: shapes the built-in tiny-llama; with model: {model} remove it")
            continue
        known = [*ENGINE_OPTIONS, *TINY_MODEL_OPTIONS]
        raise ValueError(
            f"options.{key}: not a gpubroker engine option;{did_you_mean(key, known) or ' remove it.'} "
            f"vLLM's own arguments go under engine_kwargs: (e.g. engine_kwargs: {{{key}: ...}}); gpubroker's "
            f"options are {', '.join(ENGINE_OPTIONS)}"
        )
    for key, value in engine_kwargs.items():
        if not isinstance(key, str):
            raise ValueError(f"engine_kwargs.{key}: argument names are strings (vLLM's names)")
        if key in BROKER_SET:
            raise ValueError(f"engine_kwargs.{key}: set by gpubroker; {BROKER_SET[key]}")
        if key in _INT_MOVED and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"engine_kwargs.{key}: {value!r} must be a whole number >= 1")
    for old, renamed in DEPRECATED_OPTIONS.items():
        target = renamed.new.partition(".")[2]
        if old in options and renamed.new.startswith("engine_kwargs.") and target in engine_kwargs:
            raise ValueError(
                f"options.{old}: deprecated, and {renamed.new} is written too; keep {renamed.new} and remove options.{old}"
            )
    if "model_dir" in options and model != "tiny-llama":
        raise ValueError(f"options.model_dir: model: {model} names the model already; remove options.model_dir")


def deprecated_options(options: Mapping[str, Any]) -> list[str]:
    """One message per old key in ``options``, naming the key to write instead (validate's warnings)."""
    out = []
    for key in options:
        renamed = DEPRECATED_OPTIONS.get(key)
        if renamed is not None:
            how = f" ({renamed.note})" if renamed.note else ""
            out.append(f"options.{key} is deprecated and read for one more release: write {renamed.new} instead{how}")
    return out
