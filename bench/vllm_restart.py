"""What a KV cache resize costs on vLLM's CPU build, for each driver of ``VllmEngine``.

A resize drains the engine, then shuts vLLM down and builds it again with the new cache. With
``AsyncLLM`` the build spawns the engine core and (vLLM's CPU executor) its worker; in process
(``gpubroker.deployments.llm.inline_vllm``) it loads the model and allocates the cache in the replica's
process. Each driver: one start, then ``--resizes`` resizes of an idle engine between 6 and 12
blocks, each followed by one request that must complete; the resident memory of this process
after each (the in-process engine must give its old cache back). Run in ``.venv-vllm``:
``python -m bench.vllm_restart --out bench/results/2026-12-05-vllm-restart/restart.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def rss_mib() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


async def one_request(engine: Any, rid: str) -> int:
    from gpubroker.deployments.llm.engine import GREEDY

    tokens, last = await engine.submit(rid, list(range(5, 60)), 16, GREEDY).collect()
    assert last.finish_reason is not None and last.error is None, last.error
    return len(tokens)


async def measure(in_process: bool, resizes: int, log=print) -> dict[str, Any]:
    from dataclasses import replace

    from bench.llm_bench import engine_options
    from gpubroker.deployments.llm.vllm_engine import VllmEngine

    engine = VllmEngine(replace(engine_options(8, 8), in_process=in_process))
    t0 = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - t0
    restart_s, rss = [], [rss_mib()]
    try:
        await one_request(engine, "warm")
        for i in range(resizes):
            engine.set_kv_cache_blocks(12 if i % 2 == 0 else 6)
            await engine.wait_resized()
            restart_s.append(round(engine.stats().last_restart_s, 3))
            await one_request(engine, f"r{i}")
            rss.append(rss_mib())
    finally:
        await engine.stop()
    out = {
        "driver": "in-process" if in_process else "AsyncLLM",
        "start_s": round(start_s, 2),
        "restart_s": restart_s,
        "restart_s_median": round(statistics.median(restart_s), 2),
        "rss_mib_after_each": rss,
    }
    log(
        f"  {out['driver']}: start {out['start_s']} s, restart median {out['restart_s_median']} s, rss {rss[0]} -> {rss[-1]} MiB"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--resizes", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    res = {"resizes": args.resizes, "drivers": []}
    for in_process in (True, False):
        res["drivers"].append(asyncio.run(measure(in_process, args.resizes)))
    a, b = res["drivers"]
    res["restart_ratio"] = round(b["restart_s_median"] / a["restart_s_median"], 1)
    print(f"AsyncLLM / in-process restart: {res['restart_ratio']}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
