"""The LLM benchmark's client and engine side: requests, their records, and their open-loop replay.

Used inside each engine's process (``bench.llm_procs.EngineProc``): a request is sent at its
scheduled time, TTFT counts from that time, and a client gives up on a request with no first
token by the TTFT SLO (cancelled: a miss). ``reset`` brings an engine back to an arm's start and
``engine_delta`` says what vLLM did during the arm.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

TTFT_SLO_MS, TPOT_SLO_MS = 4000.0, 1000.0  # generous: two shared CPU cores run every arm


@dataclass(frozen=True)
class Req:
    t_s: float  # scheduled arrival from the start of the run
    prompt: int  # prompt tokens
    gen: int  # tokens to generate


@dataclass(frozen=True)
class Rec:
    model: str
    t_s: float
    ok: bool
    ttft_ms: float | None
    tpot_ms: float | None
    tokens: int


async def _one(engine: Any, model: str, rid: str, req: Req, t0: float, out: list[Rec]) -> None:
    await asyncio.sleep(max(0.0, t0 + req.t_s - time.perf_counter()))
    rng = np.random.default_rng(zlib.crc32(rid.encode()))
    stream = engine.submit(rid, [int(t) for t in rng.integers(0, 256, req.prompt)], req.gen)
    first = last = None
    n = 0
    ok = False
    deadline = t0 + req.t_s + TTFT_SLO_MS / 1000.0
    while True:
        # the client gives up on a request with no first token by its TTFT SLO (cancelled: a miss),
        # every arm alike, so one backlog costs the requests in it, not every request after it
        wait = None if first is not None else max(0.0, deadline - time.perf_counter())
        try:
            delta = await asyncio.wait_for(stream.__anext__(), wait)
        except (StopAsyncIteration, TimeoutError):
            break
        now = time.perf_counter()
        if delta.token_ids:
            first = first or now
            last = now
            n += len(delta.token_ids)
        if delta.finished:
            ok = str(delta.finish_reason) in ("stop", "length")
            break
    ttft = None if first is None else (first - (t0 + req.t_s)) * 1000.0
    tpot = None if first is None or n < 2 else (last - first) * 1000.0 / (n - 1)
    out.append(Rec(model, req.t_s, ok, ttft, tpot, n))


async def replay(engines: dict[str, Any], loads: dict[str, list[Req]], t0: float, until_s: float) -> list[Rec]:
    """Every request at its time; at ``until_s`` after the start the ones still open are cancelled
    (their streams closed, their sequences freed) and count as misses."""
    recs: list[Rec] = []
    tasks = [
        asyncio.create_task(_one(engines[m], m, f"{m}-{i}", r, t0, recs))
        for m, reqs in loads.items()
        for i, r in enumerate(reqs)
    ]
    _, late = await asyncio.wait(tasks, timeout=max(0.0, t0 + until_s - time.perf_counter()))
    for t in late:
        t.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    done = {(r.model, r.t_s) for r in recs}
    recs += [Rec(m, r.t_s, False, None, None, 0) for m, reqs in loads.items() for r in reqs if (m, r.t_s) not in done]
    return recs


async def reset(engine: Any, opts: Any) -> None:
    """Back to the arm's starting point: the configured bounds and cache (a restart if it moved)."""
    engine.set_bounds(opts.max_num_seqs, opts.max_batched_tokens, False)
    engine.set_kv_cache_blocks(opts.kv_cache_blocks)
    await engine.wait_resized()


def engine_delta(a: Any, b: Any) -> dict[str, Any]:
    """What vLLM did during the arm: restarts (KV resizes) and their seconds, preemptions, prefix hits."""
    return {
        "restarts": b.rebuilds - a.rebuilds,
        "restart_s": round(b.restart_s_total - a.restart_s_total, 1),
        "preemptions": b.preemptions - a.preemptions,
        "prefix_cache_hits": b.prefix_cache_hits - a.prefix_cache_hits,
        "kv_blocks_end": b.kv_blocks_total,
    }
