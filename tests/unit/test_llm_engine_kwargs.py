"""vLLM's own argument names on a real engine (issue 53): a ``kind: llm`` model's ``engine_kwargs``
reach vLLM as written, its ``model:`` is a local Hugging Face directory, and ``gpubroker validate``
refuses a name the installed vLLM does not know, naming the closest one and vLLM's version.
Runs in .venv-vllm (``make test-llm``); skipped where vLLM is not installed."""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
vllm = pytest.importorskip("vllm")

from gpubroker.deployments.llm.engine_config import engine_options  # noqa: E402
from gpubroker.deployments.llm.tiny_model import ByteTokenizer, ensure_tiny_llama  # noqa: E402
from gpubroker.deployments.llm.vllm_engine import VllmEngine  # noqa: E402
from gpubroker.quotas.config import parse_config_text  # noqa: E402
from gpubroker.validate import check_llms  # noqa: E402


def fleet(model: str, engine_kwargs: str) -> str:
    return (
        "gpu: {device: cpu, capacity: 1GiB}\nmodels:\n  chat:\n    kind: llm\n"
        f"    model: '{model}'\n    engine_kwargs: {engine_kwargs}\n"
        "    options: {kv_cache_blocks_min: 5, kv_cache_blocks_max: 8}\n"
        "    quota: {min: 64MiB, base: 128MiB, max: 256MiB}\n"
    )


def test_an_engine_starts_with_vllms_own_arguments_from_a_local_directory():
    """bfloat16 (not the built-in's float32) and 64-token blocks reach vLLM; the broker's block
    accounting follows them: a block is 2 layers x K,V x 2 heads x 64 x 64 tokens x 2 bytes."""
    directory = str(ensure_tiny_llama())
    text = fleet(directory, "{dtype: bfloat16, max_model_len: 256, block_size: 64, num_gpu_blocks_override: 6}")
    spec = parse_config_text(text).models["chat"]
    engine = VllmEngine(engine_options(dict(spec.options), dict(spec.engine_kwargs), spec.model, spec.llm))

    async def run() -> tuple[list[int], object]:
        await engine.start()
        try:
            return await engine.submit("r1", ByteTokenizer().encode("hello"), 8).collect()
        finally:
            await engine.stop()

    loop = asyncio.new_event_loop()
    try:
        tokens, last = loop.run_until_complete(run())
    finally:
        loop.close()
    assert len(tokens) >= 1 and last.finish_reason is not None and last.error is None
    s = engine.stats()
    assert (s.kv_block_tokens, s.kv_blocks_total, engine.max_model_len) == (64, 6, 256)
    assert s.kv_block_bytes == 2 * 2 * 2 * 64 * 64 * 2


def test_validate_refuses_a_name_vllm_does_not_have_naming_the_closest_and_the_version():
    cfg = parse_config_text(fleet(str(ensure_tiny_llama()), "{max_num_seq: 8, dtype: float32}"))
    got = check_llms(cfg)
    assert [i.path for i in got.issues] == ["models.chat.engine_kwargs.max_num_seq"]
    message = got.issues[0].message
    assert f"vLLM {vllm.__version__}" in message and "did you mean 'max_num_seqs'?" in message
    assert got.checked == f"engine_kwargs checked against vLLM {vllm.__version__}'s arguments"
