"""vLLM's CUDA build under the broker's rules (skipped without CUDA or vLLM). ``scripts/gpu-check
--llm`` runs the same ``CHECKS`` without pytest.

The engine is the CPU path's code (``gpubroker.deployments.llm.vllm_engine.VllmEngine``) with
``device: cuda``: ``gpu_memory_utilization`` from the grant at start, and an idle engine asked
for its smallest cache sleeps (``AsyncLLM.sleep(level=1)``: KV cache freed, weights to host)
until a request wakes it. The card's memory is read by NVML (vLLM's engine core is another
process). Written against vLLM's API; run only where a GPU is lent.
"""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GiB = 1024**3
KV_BLOCKS = 4096  # 4096 x 256 KiB = 1 GiB of KV cache: a drop NVML cannot miss


def _card_used_bytes() -> int:
    from gpubroker.deployments.enforce.probes import NvmlProbe

    return NvmlProbe.for_torch_device(0).read().used_bytes


def check_vllm_cuda_grant_sleep_and_wake() -> str:
    """Start within a grant (gpu_memory_utilization), generate, sleep level 1 frees the KV cache,
    a request wakes the engine and is answered."""
    from gpubroker.deployments.llm.engine import FinishReason
    from gpubroker.deployments.llm.tiny_model import ByteTokenizer, ensure_tiny_llama
    from gpubroker.deployments.llm.vllm_engine import VllmEngine, VllmEngineOptions

    total = int(torch.cuda.get_device_properties(0).total_memory)
    grant_frac = round(min(0.5, (KV_BLOCKS * 256 * 1024 + 3 * GiB) / total), 3)
    opts = VllmEngineOptions(
        model_dir=str(ensure_tiny_llama()),
        device="cuda",
        kv_cache_blocks=KV_BLOCKS,
        kv_cache_blocks_min=5,
        kv_cache_blocks_max=KV_BLOCKS,
        gpu_memory_utilization=grant_frac,
    )
    tok = ByteTokenizer()

    async def body() -> str:
        engine = VllmEngine(opts)
        await engine.start()
        try:
            results = await asyncio.gather(
                *(engine.submit(f"g{i}", tok.encode(f"hello {i}"), 16).collect() for i in range(8))
            )
            assert all(last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for _, last in results)
            awake = _card_used_bytes()
            assert awake <= grant_frac * total + 1 * GiB, f"card use {awake / GiB:.2f} GiB over the grant"
            engine.set_kv_cache_blocks(opts.kv_cache_blocks_min)  # idle and shrunk to the minimum: sleep
            await engine.wait_resized()
            assert engine.stats().asleep and engine.kv_cache_bytes() == 0
            asleep = _card_used_bytes()
            freed = awake - asleep
            assert freed >= 0.5 * KV_BLOCKS * engine.block_bytes(), f"sleep freed only {freed / GiB:.2f} GiB"
            tokens, last = await engine.submit("wake", tok.encode("wake up"), 8).collect()
            assert tokens and last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
            assert not engine.stats().asleep
            return (
                f"grant {grant_frac:.3f} of {total / GiB:.0f} GiB; card use awake {awake / GiB:.2f} GiB, "
                f"asleep {asleep / GiB:.2f} GiB (freed {freed / GiB:.2f}); woke on demand"
            )
        finally:
            await engine.stop()

    return asyncio.run(body())


CHECKS = [("vllm cuda: grant, sleep level 1, wake", check_vllm_cuda_grant_sleep_and_wake)]


def test_vllm_cuda_grant_sleep_and_wake():
    check_vllm_cuda_grant_sleep_and_wake()
