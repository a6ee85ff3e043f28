"""One vLLM engine alone on the first burst of ``bench llm``'s bursty load, at a few fixed settings.

What a setting serves with nothing else moving: the static split's 8 KV blocks against the 18 a
bursting engine grows to, and the step size (``max_batched_tokens``) the engine is configured with
against its ceiling. Every setting gets the same requests (seed 0's first burst, ``BURST_RPS``, for
``DURATION_S``) under the benchmark's rules (client deadline at the TTFT SLO, the engines' queue
wait). ``python -m bench.llm_probe --out DIR`` (in ``.venv-vllm``) writes ``llm-probe.json``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import llm_bench as lb
from bench.llm_procs import ray_up, start_engines, stop_engines
from bench.sim_figures import code_version

DURATION_S = 30.0
SETTINGS = {  # name -> (KV blocks, max_num_seqs, max_batched_tokens)
    "kv8": (8, 8, 512),
    "kv8-tokens1024": (8, 8, 1024),
    "kv8-tokens2048": (8, 8, 2048),
    "kv18": (18, 18, 512),
    "kv18-tokens1024": (18, 18, 1024),
    "kv18-tokens2048": (18, 18, 2048),
}


async def probe(log=print) -> list[dict[str, Any]]:
    loads = {"a": lb.workload(lb.BURST_RPS, DURATION_S, seed=0, poisson=True)}
    rows = []
    for name, (blocks, seqs, tokens) in SETTINGS.items():
        engines = await start_engines(("a",), replace(lb.engine_options(blocks, seqs), max_batched_tokens=tokens))
        try:
            arm = await lb.run_arm(name, engines, loads, DURATION_S, log=log)
        finally:
            await stop_engines(engines)
        rows.append({"setting": name, "kv_blocks": blocks, "max_num_seqs": seqs, "max_batched_tokens": tokens, **arm})
    return rows


def main(out: Path) -> dict[str, Any]:
    t0 = time.time()
    ray_up()
    res = {"rate": lb.BURST_RPS, "duration_s": DURATION_S, "code": code_version(), "runs": asyncio.run(probe())}
    res["runtime_s"] = round(time.time() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llm-probe.json").write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    return res


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    for r in main(ap.parse_args().out)["runs"]:
        print(
            f"{r['setting']}: goodput {r['goodput_rps']}/s, attainment {r['attainment']}, TTFT P50 {r['ttft_p50_ms']} ms"
        )
