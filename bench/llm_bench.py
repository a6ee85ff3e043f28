"""Benchmark ``llm``: the broker's LLM rules driving a CPU engine against static bounds, and lending between two LLMs.

The Azure LLM inference trace 2023 (code; CC-BY 4.0, Patel et al., "Splitwise", ISCA 2024)
gives arrival gaps (scaled to the offered rate), ContextTokens and GeneratedTokens, scaled to
the tiny model's context (``scale_lengths``). Requests are replayed open loop, in process,
against ``deployments.llm.cpu_engine.CpuEngine`` (no Serve: the engine comparison needs
none); TTFT counts from the scheduled arrival, so queueing at the admission counts.

Arms, each on a fresh engine with the same KV cache and the same requests:

- ``static-8``: ``max_num_seqs`` 8, never moved; ``static-N`` over a small grid (best reported);
- ``broker``: a ``BrokerCore`` on the real clock drives the engine through the server's report
  loop (``deployments.llm.report_loop.EngineReporter``, its broker handle calling the core in
  process): reports every ``report_interval_s``, ticks every ``control_interval_s``;
- two LLMs on one card (``a`` busy first, then idle while ``b`` bursts), memory-bound (the
  KV cache a grant holds limits ``max_num_seqs``): lending on (quota max over base) against
  lending off (min = base = max). The KV cache moves between them through the ledger.

Goodput: requests per second that finished within both the TTFT and the TPOT SLO.
``python -m bench.llm_bench --quick --out bench/out`` or ``gpubroker bench llm``.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpubroker.sim.arrivals import trace_path

TTFT_SLO_MS, TPOT_SLO_MS = 4000.0, 1000.0  # generous: two shared CPU cores run every arm
MAX_MODEL_LEN = 128
GEN_MAX = 24
GRACE_S = 10.0  # after the last arrival, requests still open this much later are cancelled (misses)


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


def load_rows(path: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gaps s, ContextTokens, GeneratedTokens) of the trace, in time order."""
    stamps, ctx, gen = [], [], []
    with Path(trace_path(path)).open(encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            stamps.append(row["TIMESTAMP"].strip())
            ctx.append(int(row["ContextTokens"]))
            gen.append(int(row["GeneratedTokens"]))
    ts = np.array(stamps, dtype="datetime64[ns]").astype(np.int64)
    order = np.argsort(ts, kind="stable")
    gaps = np.diff(ts[order]).astype(np.float64) / 1e9
    return np.concatenate([[gaps.mean()], gaps]), np.asarray(ctx)[order], np.asarray(gen)[order]


def scale_lengths(
    ctx: np.ndarray, gen: np.ndarray, max_model_len: int = MAX_MODEL_LEN, gen_max: int = GEN_MAX
) -> tuple[np.ndarray, np.ndarray]:
    """Trace lengths in the tiny model's context: prompts scaled so their median is an eighth of
    the context (and at most what leaves room for the output), outputs capped at ``gen_max``."""
    g = np.clip(gen, 1, gen_max)
    p = np.round(ctx * (max_model_len / 8.0) / max(1.0, float(np.median(ctx)))).astype(int)
    return np.clip(p, 4, max_model_len - g - 1), g


def workload(
    rate: float, duration_s: float, seed: int = 0, start_s: float = 0.0, poisson: bool = False, gen_max: int = GEN_MAX
) -> list[Req]:
    """The trace from a row chosen by ``seed``: its gaps scaled to ``rate`` (or Poisson arrivals at
    ``rate``: the trace's clumps would end a burst early) and its scaled lengths."""
    gaps, ctx, gen = load_rows()
    prompt, out = scale_lengths(ctx, gen, gen_max=gen_max)
    i = int(np.random.default_rng(seed).integers(0, len(gaps)))
    if poisson:
        from gpubroker.sim.arrivals import poisson as poisson_times

        times = poisson_times(rate, duration_s, seed=seed)
        n = len(gaps)
        return [
            Req(round(start_s + float(t), 4), int(prompt[(i + k) % n]), int(out[(i + k) % n]))
            for k, t in enumerate(times)
        ]
    scale = 1.0 / (gaps.mean() * rate)
    t, reqs = start_s, []
    while True:
        t += gaps[i % len(gaps)] * scale
        if t >= start_s + duration_s:
            return reqs
        reqs.append(Req(round(t, 4), int(prompt[i % len(gaps)]), int(out[i % len(gaps)])))
        i += 1


def engine_options(kv_blocks: int, seqs: int, hidden: int = 64, kv_heads: int = 2) -> Any:
    from deployments.llm.cpu_engine import CpuEngineOptions
    from deployments.llm.tiny_model import TinyLlamaSpec

    spec = TinyLlamaSpec(
        hidden_size=hidden, intermediate_size=2 * hidden, num_kv_heads=kv_heads, max_model_len=MAX_MODEL_LEN
    )
    return CpuEngineOptions(
        model=spec,
        kv_cache_blocks=kv_blocks,
        kv_cache_blocks_max=max(kv_blocks, 512),
        max_num_seqs=seqs,
        max_num_seqs_max=64,
        max_batched_tokens=512,
    )


async def _one(engine: Any, model: str, rid: str, req: Req, t0: float, out: list[Rec]) -> None:
    await asyncio.sleep(max(0.0, t0 + req.t_s - time.perf_counter()))
    stream = engine.submit(rid, [3 + (k % 250) for k in range(req.prompt)], req.gen)
    first = last = None
    n = 0
    ok = False
    async for delta in stream:
        now = time.perf_counter()
        if delta.token_ids:
            first = first or now
            last = now
            n += len(delta.token_ids)
        if delta.finished:
            ok = str(delta.finish_reason) in ("stop", "length")
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


def summary(recs: list[Rec], duration_s: float, model: str | None = None) -> dict[str, Any]:
    rs = [r for r in recs if model is None or r.model == model]
    good = [
        r
        for r in rs
        if r.ok
        and r.ttft_ms is not None
        and r.ttft_ms <= TTFT_SLO_MS
        and (r.tpot_ms is None or r.tpot_ms <= TPOT_SLO_MS)
    ]

    def pct(key: str, q: float) -> float | None:
        xs = [getattr(r, key) for r in rs if getattr(r, key) is not None]
        return round(float(np.percentile(xs, q)), 1) if xs else None

    return {
        "requests": len(rs),
        "completed": sum(r.ok for r in rs),
        "within_slo": len(good),
        "goodput_rps": round(len(good) / duration_s, 3),
        "attainment": round(len(good) / max(1, len(rs)), 3),
        "ttft_p50_ms": pct("ttft_ms", 50),
        "ttft_p95_ms": pct("ttft_ms", 95),
        "tpot_p95_ms": pct("tpot_ms", 95),
        "tokens_out_per_s": round(sum(r.tokens for r in rs) / duration_s, 1),
    }


# ------------------------------------------------------------------ the broker in process
class _Remote:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        async def call():
            return self._fn(*args)

        return call()


class _Handle:
    """The broker actor's handle in front of an in-process core: plain data both ways, as over Ray."""

    def __init__(self, core: Any):
        from broker.wire import StatsReport

        self.report = _Remote(lambda report: core.report(StatsReport.from_dict(report)).to_dict())


def broker_config(models: dict[str, dict[str, Any]], capacity: str, reserve_frac: float = 0.2) -> str:
    """A fleet YAML of ``kind: llm`` models (name -> {options, llm, quota, control})."""
    import yaml

    doc = {
        "broker": {"control_interval_s": 1.0, "report_interval_s": 0.5},
        "gpu": {"device": "cpu", "capacity": capacity, "reserve_frac": reserve_frac, "emergency_free_frac": 0.05},
        "models": {n: {"kind": "llm", "model": "tiny-llama", **m} for n, m in models.items()},
    }
    return yaml.safe_dump(doc, sort_keys=False)


def _options_dict(o: Any) -> dict[str, Any]:
    d = {k: v for k, v in asdict(o).items() if k != "model"}
    d.update({k: v for k, v in asdict(o.model).items()})
    return d


async def run_arm(
    arm: str,
    opts: dict[str, Any],
    loads: dict[str, list[Req]],
    duration_s: float,
    config_text: str | None = None,
    log=print,
) -> dict[str, Any]:
    """One arm: fresh engines (``opts``: model -> CpuEngineOptions), the broker when ``config_text``."""
    from broker.core import BrokerCore
    from deployments.llm.cpu_engine import CpuEngine
    from deployments.llm.report_loop import EngineReporter
    from deployments.llm.server import engine_report

    engines = {m: CpuEngine(o) for m, o in opts.items()}
    for e in engines.values():
        await e.start()
    core, tasks, trace_bounds = None, [], []
    if config_text is not None:
        core = BrokerCore(config_text)
        idle_since = {m: time.monotonic() for m in engines}

        def reporter(m: str) -> EngineReporter:
            e = engines[m]

            def rep() -> dict[str, Any]:
                st = e.stats()
                if st.running or st.waiting:
                    idle_since[m] = time.monotonic()
                return engine_report(e, 0.0 if (st.running or st.waiting) else time.monotonic() - idle_since[m], m)

            return EngineReporter(m, f"{m}-bench", e, lambda: _Handle(core), report_interval_s=0.5, engine_report=rep)

        reps = [reporter(m) for m in engines]
        for r in reps:
            await r.report_once()

        async def ticks():
            while True:
                await asyncio.sleep(1.0)
                core.tick()
                st = core.status()["models"]
                trace_bounds.append(
                    {
                        m: {k: st[m]["engine"].get(k) for k in ("max_num_seqs", "kv_blocks", "prefill_paused")}
                        | {"grant_bytes": st[m]["grant_bytes"]}
                        for m in engines
                    }
                )

        tasks = [asyncio.create_task(r.run()) for r in reps] + [asyncio.create_task(ticks())]
    t0 = time.perf_counter() + 0.5
    try:
        recs = await replay(engines, loads, t0, duration_s + GRACE_S)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for e in engines.values():
            await e.stop()
    out = {"arm": arm, **summary(recs, duration_s), "models": {m: summary(recs, duration_s, m) for m in engines}}
    if core is not None:
        entries = [e for e in core.decisions() if e["kind"] in ("engine", "move")]
        t_wall = time.time() - (time.perf_counter() - t0)  # the run's start on the broker's clock
        out["engine_log"] = [
            {
                "t_s": round(e["time_s"] - t_wall, 1),
                "model": e["model"],
                "rule": e.get("rule") or str(e.get("move")),
                "reason": e["reason"],
            }
            for e in entries
        ]
        out["rules"] = sorted({str(e.get("rule") or e.get("move")) for e in entries})
        out["moves"] = [
            {
                "move": str(e["move"]),
                "donor": e["donor"],
                "recipient": e["recipient"],
                "amount_bytes": e["amount_bytes"],
            }
            for e in entries
            if e["kind"] == "move"
        ]
        out["bounds_trace"] = trace_bounds
        out["max_num_seqs_max_seen"] = {
            m: max((b[m]["max_num_seqs"] or 0) for b in trace_bounds) if trace_bounds else None for m in engines
        }
    log(f"  {arm}: goodput {out['goodput_rps']}/s, attainment {out['attainment']}, TTFT P95 {out['ttft_p95_ms']} ms")
    return out


# ------------------------------------------------------------------ scenarios
async def warmup(log=print) -> None:
    """A throwaway engine through every batch shape first: the process's first steps are slow."""
    t0 = time.perf_counter()
    await run_arm("warmup", {"w": engine_options(384, 32)}, {"w": workload(8.0, 4.0, seed=9)}, 4.0, log=lambda m: None)
    log(f"  warm-up {time.perf_counter() - t0:.0f} s")


async def single(quick: bool, log=print) -> dict[str, Any]:
    await warmup(log)
    duration = 20.0 if quick else 60.0
    rate = 3.0
    loads = {"llm": workload(rate, duration, seed=0)}
    grid = (32,) if quick else (4, 16, 24, 32)
    kv = 384
    arms = []
    for n in (8, *grid):
        arms.append(await run_arm(f"static-{n}", {"llm": engine_options(kv, n)}, loads, duration, log=log))
    text = broker_config(
        {
            "llm": {
                "options": _options_dict(engine_options(kv, 8)),
                "llm": {"expected_peak_concurrency": 32, "ttft_slo_ms": TTFT_SLO_MS, "tpot_slo_ms": TPOT_SLO_MS},
                "quota": {"min": "64MiB", "base": "256MiB", "max": "256MiB"},
            }
        },
        "1GiB",
    )
    arms.append(await run_arm("broker", {"llm": engine_options(kv, 8)}, loads, duration, text, log=log))
    static = [a for a in arms if a["arm"].startswith("static-")]
    best = max(static, key=lambda a: a["goodput_rps"])
    s8 = next(a for a in static if a["arm"] == "static-8")
    broker = arms[-1]
    return {
        "rate_rps": rate,
        "duration_s": duration,
        "requests": len(loads["llm"]),
        "arms": arms,
        "best_static": best["arm"],
        "broker_over_static8": _ratio(broker, s8),
        "broker_over_best_static": _ratio(broker, best),
    }


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    return round(a["goodput_rps"] / b["goodput_rps"], 3) if b["goodput_rps"] else None


async def two_llms(quick: bool, log=print) -> dict[str, Any]:
    """a busy, then idle while b bursts (Poisson arrivals, trace lengths); memory-bound: the KV
    cache b's base grant holds limits its max_num_seqs to 3 worst-case sequences."""
    calm, burst = (6.0, 30.0) if quick else (20.0, 60.0)
    duration = calm + burst
    loads = {
        "a": workload(2.0, calm, seed=1, poisson=True),
        "b": workload(0.3, calm, seed=2, poisson=True)
        + workload(36.0, burst, seed=3, start_s=calm, poisson=True, gen_max=64),  # long answers hold sequences
    }
    o = engine_options(64, 4, hidden=128, kv_heads=4)  # 32 KiB blocks: 8 blocks (256 KiB) per worst-case sequence
    control = {"window_s": 6, "idle_hold_s": 3, "reclaim_hold_s": 2}
    llm = {"expected_peak_concurrency": 16, "ttft_slo_ms": TTFT_SLO_MS, "tpot_slo_ms": TPOT_SLO_MS}
    res = {"calm_s": calm, "burst_s": burst, "requests": {m: len(r) for m, r in loads.items()}, "arms": []}
    for arm, b_max in (("lending-off", "2560KiB"), ("lending-on", "12MiB")):
        a_quota = {"min": "2MiB", "base": "8MiB", "max": "8MiB"}
        b_quota = {"min": "2MiB", "base": "2560KiB", "max": b_max}
        text = broker_config(
            {
                "a": {"options": _options_dict(o), "llm": llm, "quota": a_quota, "control": control},
                "b": {"options": _options_dict(o), "llm": llm, "quota": b_quota, "control": control},
            },
            "16MiB",
        )
        res["arms"].append(await run_arm(arm, {"a": o, "b": o}, loads, duration, text, log=log))
    off, on = res["arms"]
    res["lending_gain"] = _ratio(on, off)
    res["b_gain"] = (
        round(on["models"]["b"]["goodput_rps"] / off["models"]["b"]["goodput_rps"], 3)
        if off["models"]["b"]["goodput_rps"]
        else None
    )
    return res


def run(quick: bool = False, out: Path | None = None, log=print) -> dict[str, Any]:
    t0 = time.time()
    res = {"ttft_slo_ms": TTFT_SLO_MS, "tpot_slo_ms": TPOT_SLO_MS, "max_model_len": MAX_MODEL_LEN, "quick": quick}
    log("llm: one engine, broker vs static max_num_seqs")
    res["single"] = asyncio.run(single(quick, log))
    log("llm: two LLMs on one card, lending off vs on")
    res["two_llms"] = asyncio.run(two_llms(quick, log))
    res["runtime_s"] = round(time.time() - t0, 1)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "llm.json").write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    return res


def table(res: dict[str, Any]) -> str:
    rows = [
        "| arm | requests | within SLO | goodput req/s | attainment | TTFT P50 ms | TTFT P95 ms | TPOT P95 ms | tok/s out |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def row(name: str, s: dict[str, Any]) -> str:
        f = lambda v: "-" if v is None else (f"{v:g}" if isinstance(v, (int, float)) and not math.isnan(v) else str(v))  # noqa: E731
        return (
            f"| {name} | {s['requests']} | {s['within_slo']} | {f(s['goodput_rps'])} | {f(s['attainment'])} | "
            f"{f(s['ttft_p50_ms'])} | {f(s['ttft_p95_ms'])} | {f(s['tpot_p95_ms'])} | {f(s['tokens_out_per_s'])} |"
        )

    single = res["single"]
    rows += [row(a["arm"], a) for a in single["arms"]]
    two = res["two_llms"]
    for a in two["arms"]:
        rows.append(row(f"two LLMs, {a['arm']} (fleet)", a))
        rows += [row(f"&nbsp;&nbsp;{a['arm']}: {m}", s) for m, s in a["models"].items()]
    notes = (
        f"\nOne engine at {single['rate_rps']} req/s for {single['duration_s']:.0f} s: broker / static-8 goodput "
        f"{single['broker_over_static8']}, broker / best static ({single['best_static']}) "
        f"{single['broker_over_best_static']}. Two LLMs: lending on / off fleet goodput {two['lending_gain']}, "
        f"bursting model b {two['b_gain']}. SLOs: TTFT P95 {res['ttft_slo_ms']:g} ms, TPOT P95 "
        f"{res['tpot_slo_ms']:g} ms per request. Runtime {res['runtime_s']:.0f} s."
    )
    return "\n".join(rows) + "\n" + notes


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    args = ap.parse_args()
    print(table(run(args.quick, args.out)))
