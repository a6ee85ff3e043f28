"""``python -m bench lending``: where memory binds, does lending buy goodput?

Lending proves something only where the static split runs out of memory: four models on one
16 GiB card, each limited by its batch memory (1 GiB of weights + 512 MiB per item, so a 3.5 GiB
base holds a batch of 5), each bursting in turn (gamma CV 2) past what batches of 5 serve. Arms,
all with the same lazy batch formation: ``static-split``, ``broker-fixed`` (quotas fixed at base),
``broker`` (lending on); ``static-split-timeout`` beside them. Both broker arms shed late
requests, so a gain over ``broker-fixed`` is the borrowed memory, not a queue's collapse. An
ablation turns each part on alone; a second load has every model burst on its own, where the
broker must match the static split on each model. Memory is enforced as ``gpubroker.sim.engine``
enforces it; the simulator keeps the runs fast and deterministic (the live stack runs the same
policy code).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gpubroker.quotas.config import FleetConfig, parse_config
from gpubroker.sim import arrivals as arr
from gpubroker.sim.engine import SimOptions, Simulator, parse_arm
from gpubroker.sim.profile import profile_for
from gpubroker.sim.types import DONE
from gpubroker.sim.workload import finish

GIB = 1024**3
MIB = 1024**2
MODELS = ("m0", "m1", "m2", "m3")
STATIC_CAP = 5  # (base 3.5 GiB - weights 1 GiB) / 512 MiB per item: the largest batch the base holds
GRANULARITY_BYTES = 2 * MIB  # allocator granularity: use above grant by less is not an over-grant
TARGET_GAIN = 1.3
IND_MEAN_RPS = 40.0
A_MS, C_MS = 5.0, 1.0  # each model's batch latency: a + c x items (ms)
STATIC_RPS = STATIC_CAP / (A_MS + C_MS * STATIC_CAP) * 1000.0  # what back-to-back batches of 5 serve: 500/s
BURST_OVER_STATIC = 1.5  # the in-turn burst: 1.5 x that (750/s), so memory, not the load, bounds the fixed arms
SLO_MS = 100.0
# Every broker arm sheds requests too late for the SLO (shed_late, gpubroker.deployments.replica.shed): without it
# an arm whose burst outruns its batches answers everything late (19 req/s within SLO), and a
# gain over it measures that collapse, not lending. The static split is Serve's as users run it;
# beside it (not a target) the static split with request_timeout_s at the SLO, the nearest
# plain Serve comes to shedding.
BROKER_OPTS: dict[str, Any] = {"shed_late": True}
TIMEOUT_STATIC_OPTS: dict[str, Any] = {"fixed": True, "request_timeout_s": SLO_MS / 1000.0}


def fleet(
    *,
    fixed: bool = False,
    formation: str = "lazy",
    strategy: str = "hybrid",
    emergency_free_frac: float = 0.10,
    shed_late: bool = False,
    request_timeout_s: float = 10.0,
) -> FleetConfig:
    """The lending card. ``fixed``: quotas pinned at base (min = base = max); ``shed_late``:
    requests too late for the SLO answered 504 at the gate (``gpubroker.deployments.replica.shed``)."""
    models = {}
    for name in MODELS:
        quota = (
            {"min": "3.5GiB", "base": "3.5GiB", "max": "3.5GiB"}
            if fixed
            else {"min": "1.5GiB", "base": "3.5GiB", "max": "8GiB"}
        )
        models[name] = {
            "model": "profiled",
            "options": {"a_ms": A_MS, "c_ms": C_MS, "weights_bytes": 1 * GIB, "bytes_per_item": 512 * MIB},
            "quota": quota,
            "batch": {"floor": 2, "ceiling": 32, "initial": STATIC_CAP},
            "wait": {"min_ms": 0, "max_ms": 20},
            "slo_p95_ms": SLO_MS,
            "max_queued": 2000,
            "request_timeout_s": request_timeout_s,
            "shed_late": shed_late,
            "control": {"strategy": strategy, "idle_hold_s": 5, "reclaim_hold_s": 1},
        }
    return parse_config(
        {
            "broker": {"control_interval_s": 1.0, "report_interval_s": 0.5, "batch_formation": formation},
            "gpu": {
                "device": "cpu",
                "capacity": "16GiB",
                "reserve_frac": 0.12,
                "emergency_free_frac": emergency_free_frac,
            },
            "models": models,
        }
    )


def in_turn(
    base_rps: float, burst_rps: float, phase_s: float, burst_s: float, seed: int
) -> tuple[list[np.ndarray], list[tuple[float, float]]]:
    """Each model bursts to ``burst_rps`` for ``burst_s`` in its own phase, in turn (gamma CV 2)."""
    out, windows = [], []
    duration = phase_s * len(MODELS)
    for i in range(len(MODELS)):
        start = i * phase_s + (phase_s - burst_s) / 2
        end = start + burst_s
        windows.append((start, end))
        segs = [(0.0, start, base_rps), (start, end, burst_rps), (end, duration, base_rps)]
        out.append(arr.piecewise(segs, seed=seed * 100 + i, kind="gamma", cv=2.0))
    return out, windows


def independent(mean_rps: float, duration_s: float, seed: int) -> list[np.ndarray]:
    """Every model bursts on its own: gamma CV 4 at the same mean rate, all contending."""
    return [arr.gamma(mean_rps, duration_s, 4.0, seed * 100 + 50 + i) for i in range(len(MODELS))]


def workload(cfg: FleetConfig, times: list[np.ndarray]):
    """Each model's requests (arrival times, with their cost and memory from its profile) for the simulator."""
    return {n: finish(t, profile_for(n, cfg.models[n]), None, 0) for n, t in zip(MODELS, times)}


def arm_rules(cfg: FleetConfig, arm: str) -> dict[str, Any]:
    """The deadline and shedding rule this arm ran under (recorded with it: one rule for every arm is
    what makes two arms comparable). Shedding runs at the lazy gate: the broker with lazy formation,
    or a gated static arm."""
    a = parse_arm(arm)
    gated = a.gated or (a.kind == "broker" and str(cfg.broker.batch_formation) == "lazy")
    return {
        "shed_at_cap": gated and all(m.shed_late for m in cfg.models.values()),
        "deadline_s": sorted({float(m.request_timeout_s) for m in cfg.models.values()}),
        "late_answer": "miss",
    }


def run_arm(
    cfg: FleetConfig,
    arm: str,
    times: list[np.ndarray],
    duration_s: float,
    warmup_s: float,
    windows: list[tuple[float, float]] | None = None,
    sim_cls: type[Simulator] = Simulator,
) -> dict[str, Any]:
    """One arm: fleet goodput, per-model attainment (and off-burst attainment), OOMs, over-grants.
    ``sim_cls``: a variant of the simulator (``bench.lending_gap`` tries one gate change)."""
    sim = sim_cls(
        cfg,
        parse_arm(arm),
        workload(cfg, times),
        duration_s,
        SimOptions(warmup_s=warmup_s, drain_s=10.0, batching="lazy" if arm != "eager" else "eager"),
    )
    res = sim.run()
    span = duration_s - warmup_s
    lat_ms = (sim.done_t - sim.t_np) * 1000.0
    models: dict[str, Any] = {}
    good_total = 0
    for m, name in enumerate(MODELS):
        cap = cfg.models[name].slo_p95_ms
        sel = (sim.m_np == m) & (sim.t_np >= warmup_s) & (sim.t_np < duration_s)
        good = sel & (sim.status == DONE) & (lat_ms <= cap)
        good_total += int(good.sum())
        row = {
            "attainment": float(good.sum() / max(1, sel.sum())),
            "offered": int(sel.sum()),
            "goodput_rps": float(good.sum() / span),
            "p95_ms": res.models[name].p95_ms,
            "ooms": res.models[name].ooms,
            "errors": res.models[name].errors,
            "rejects": res.models[name].rejects,
            "timeouts": res.models[name].timeouts,
            "mean_batch": res.models[name].mean_batch,
            "mem_peak_bytes": res.models[name].mem_peak_bytes,
        }
        if windows is not None:
            s, e = windows[m]
            off = sel & ((sim.t_np < s) | (sim.t_np >= e + 5.0))  # outside its own burst (and 5 s of drain)
            row["attainment_off_burst"] = float((off & good).sum() / max(1, off.sum()))
            row["attainment_in_burst"] = float(
                (good & ~off & (sim.t_np >= s)).sum() / max(1, (sel & ~off & (sim.t_np >= s)).sum())
            )
        models[name] = row
    over = 0
    for name in MODELS:
        col = res.series[name]
        over += sum(1 for g, u in zip(col["grant_bytes"], col["mem_bytes"]) if g >= 0 and u > g + GRANULARITY_BYTES)
    moves = [d for d in res.decisions if d.get("move")]
    return {
        "arm": arm,
        "rules": arm_rules(cfg, arm),
        "fleet_goodput_rps": good_total / span,
        "over_grant_events": over,
        "models": models,
        "ooms": sum(r["ooms"] for r in models.values()),
        "quota_moves": len(moves),
        "wall_s": round(res.wall_s, 2),
    }


ABLATION: tuple[tuple[str, str, dict[str, Any]], ...] = (
    # (row, arm, fleet() options): the static cap with Ray's eager formation, fixed quotas, no emergency shrink
    (f"none (static {STATIC_CAP}, eager formation)", f"static:{STATIC_CAP}:10", {"fixed": True}),
    ("lazy formation alone", f"static:{STATIC_CAP}:10", {"fixed": True, "lazy": True}),
    # shedding runs at the replica's lazy gate: the gated static arm with shed_late, beside lazy formation alone
    ("late shedding (+ the lazy gate it needs)", f"static:{STATIC_CAP}:10:gate", {"fixed": True, "shed_late": True}),
    ("batch control alone", "broker", {"fixed": True, "formation": "eager", "emergency_free_frac": 1e-6}),
    ("lending alone", "broker", {"formation": "eager", "strategy": "static", "emergency_free_frac": 1e-6}),
    ("emergency shrink alone", "broker", {"fixed": True, "formation": "eager", "strategy": "static"}),
    ("all on (broker)", "broker", BROKER_OPTS),
)


IND_SEEDS = (0, 1, 2)
IND_ARMS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("static-split", f"static:{STATIC_CAP}:10", {"fixed": True}),
    ("broker-fixed", "broker", {"fixed": True, **BROKER_OPTS}),  # what lending adds is broker minus this
    ("broker", "broker", BROKER_OPTS),
    ("static-split-timeout", f"static:{STATIC_CAP}:10", TIMEOUT_STATIC_OPTS),  # beside the target, not in it
)


def independent_load(duration_s: float, seeds: tuple[int, ...], warmup_s: float = 10.0) -> dict[str, Any]:
    """The contention load on every seed: per seed the arms (``IND_ARMS``), and where the broker
    fell short of the static split (model, both attainments, and broker-fixed's beside them)."""
    per_seed: dict[str, Any] = {}
    short: list[dict[str, Any]] = []
    moves_cost: list[dict[str, Any]] = []  # broker below broker-fixed: the quota moves cost more than they bought
    short_timeout: list[dict[str, Any]] = []  # broker below the static split with request_timeout_s at the SLO
    within = {a: dict.fromkeys(MODELS, 0.0) for a in ("broker", "static-split")}  # requests within SLO, all seeds
    for seed in seeds:
        times = independent(IND_MEAN_RPS, duration_s, seed)
        arms = {name: run_arm(fleet(**opts), arm, times, duration_s, warmup_s) for name, arm, opts in IND_ARMS}
        per_seed[str(seed)] = arms
        for m in MODELS:
            b, s, f = (arms[a]["models"][m]["attainment"] for a in ("broker", "static-split", "broker-fixed"))
            if b < s:
                short.append({"seed": seed, "model": m, "broker": b, "static_split": s, "broker_fixed": f})
            if b < f:
                moves_cost.append({"seed": seed, "model": m, "broker": b, "broker_fixed": f})
            t = arms["static-split-timeout"]["models"][m]["attainment"]
            if b < t:
                short_timeout.append({"seed": seed, "model": m, "broker": b, "static_split_timeout": t})
            for a in within:
                mm = arms[a]["models"][m]
                within[a][m] += mm["attainment"] * mm["offered"]
    return {
        "seeds": per_seed,
        "short": short,
        "never_worse": not short,  # the target: every model, every seed, at least the static split
        # beside it, two readings of "its moves never cost more than they buy" (bench/RESULTS.md):
        "moves_never_cost": not moves_cost,  # broker >= broker-fixed, every model and seed
        "moves_cost": moves_cost,
        "never_worse_than_timeout_static": not short_timeout,  # beside it: against the static split at the SLO timeout
        "short_timeout": short_timeout,
        "summed_never_worse": all(within["broker"][m] >= within["static-split"][m] for m in MODELS),
        "within_slo_summed": {a: {m: round(v, 1) for m, v in per.items()} for a, per in within.items()},
    }


def run(
    *,
    quick: bool = False,
    out: Path | None = None,
    seed: int = 0,
    seeds: tuple[int, ...] = IND_SEEDS,
    on_progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``seed``: the in-turn load's; ``seeds``: the independent load's (its target holds on every one)."""
    say = on_progress or (lambda _m: None)
    t0 = time.perf_counter()
    phase_s, burst_s = (40.0, 25.0) if quick else (60.0, 40.0)
    duration = phase_s * len(MODELS)
    warmup = 10.0
    base_rps, burst_rps = 5.0, round(BURST_OVER_STATIC * STATIC_RPS, 1)
    times, windows = in_turn(base_rps, burst_rps, phase_s, burst_s, seed)
    arms = {}
    for arm_name, arm, opts in IND_ARMS:
        arms[arm_name] = run_arm(fleet(**opts), arm, times, duration, warmup, windows)
        say(
            f"in turn: {arm_name}: fleet goodput {arms[arm_name]['fleet_goodput_rps']:.1f}/s, "
            f"over-grant events {arms[arm_name]['over_grant_events']}"
        )
    ablation = []
    for row, arm, opts in ABLATION:
        opts = dict(opts)
        lazy = opts.pop("lazy", False)
        cfg = fleet(**opts)
        if arm.startswith("static"):
            sim_arm = arm
            r = (
                run_arm(cfg, sim_arm, times, duration, warmup, windows)
                if lazy
                else _run_eager(cfg, sim_arm, times, duration, warmup, windows)
            )
        else:
            r = run_arm(cfg, arm, times, duration, warmup, windows)
        ablation.append(
            {
                "parts": row,
                "rules": arm_rules(cfg, arm),
                "fleet_goodput_rps": r["fleet_goodput_rps"],
                "ooms": r["ooms"],
                "over_grant_events": r["over_grant_events"],
            }
        )
        say(f"ablation: {row}: {r['fleet_goodput_rps']:.1f}/s")
    ind_duration = 240.0 if quick else 600.0
    contention = independent_load(ind_duration, tuple(seeds), warmup)
    for k, arms_k in contention["seeds"].items():
        say(
            f"independent bursts, seed {k}: "
            + ", ".join(f"{a} {v['fleet_goodput_rps']:.1f}/s" for a, v in arms_k.items())
        )
    b, f, s = (arms[k]["fleet_goodput_rps"] for k in ("broker", "broker-fixed", "static-split"))
    off_burst = min(r["attainment_off_burst"] for r in arms["broker"]["models"].values())
    never_worse = contention["never_worse"]
    result = {
        "scenario": "lending",
        "quick": quick,
        "seed": seed,
        "load": {
            "in_turn": {
                "base_rps": base_rps,
                "burst_rps": burst_rps,
                "phase_s": phase_s,
                "burst_s": burst_s,
                "arrivals": "gamma:2",
            },
            "independent": {
                "mean_rps": IND_MEAN_RPS,
                "duration_s": ind_duration,
                "arrivals": "gamma:4",
                "seeds": list(seeds),
            },
        },
        "arms": arms,
        "ablation": ablation,
        "independent": contention,
        "targets": {
            "broker_vs_fixed": b / f if f else None,
            "broker_vs_static": b / s if s else None,
            "target_gain": TARGET_GAIN,
            "off_burst_attainment_min": off_burst,
            "over_grant_events": sum(a["over_grant_events"] for a in arms.values()),
            "independent_never_worse": never_worse,  # on every seed
            "independent_short": contention["short"],
        },
        "runtime_s": round(time.perf_counter() - t0, 1),
    }
    t = result["targets"]
    t["met"] = bool(
        t["broker_vs_fixed"]
        and t["broker_vs_fixed"] >= TARGET_GAIN
        and t["broker_vs_static"] >= TARGET_GAIN
        and off_burst >= 0.99
        and t["over_grant_events"] == 0
        and never_worse
    )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "lending.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    return result


def _run_eager(cfg, arm, times, duration, warmup, windows):
    """A static arm on Ray's eager formation (the ablation's starting point)."""
    sim = Simulator(
        cfg,
        parse_arm(arm),
        workload(cfg, times),
        duration,
        opts=SimOptions(warmup_s=warmup, drain_s=10.0, batching="eager"),
    )
    res = sim.run()
    span = duration - warmup
    lat_ms = (sim.done_t - sim.t_np) * 1000.0
    good = 0
    for m, name in enumerate(MODELS):
        sel = (sim.m_np == m) & (sim.t_np >= warmup) & (sim.t_np < duration)
        good += int((sel & (sim.status == DONE) & (lat_ms <= cfg.models[name].slo_p95_ms)).sum())
    return {"fleet_goodput_rps": good / span, "ooms": sum(r.ooms for r in res.models.values()), "over_grant_events": 0}


def table(res: dict[str, Any]) -> str:
    t = res["targets"]
    lines = [
        "| arm | fleet goodput /s | over-grant events | OOM splits | quota moves | "
        + " | ".join(f"{m} attain (off / in burst)" for m in MODELS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(MODELS),
    ]
    for name, a in res["arms"].items():
        cells = " | ".join(
            f"{a['models'][m]['attainment_off_burst']:.3f} / {a['models'][m]['attainment_in_burst']:.3f}"
            for m in MODELS
        )
        lines.append(
            f"| {name} | {a['fleet_goodput_rps']:.1f} | {a['over_grant_events']} | {a['ooms']} | "
            f"{a['quota_moves']} | {cells} |"
        )
    lines += [
        "",
        f"broker / broker-fixed **{t['broker_vs_fixed']:.2f}×**, broker / static-split "
        f"**{t['broker_vs_static']:.2f}×** (target ≥ {t['target_gain']}); lowest off-burst attainment "
        f"{t['off_burst_attainment_min']:.3f} (target ≥ 0.99); over-grant events {t['over_grant_events']} (target 0). "
        f"Targets {'met' if t['met'] else 'NOT met'}.",
        "",
        "| parts on (ablation) | fleet goodput /s | OOM splits |",
        "|---|---|---|",
    ]
    for row in res["ablation"]:
        lines.append(f"| {row['parts']} | {row['fleet_goodput_rps']:.1f} | {row['ooms']} |")
    lines += [
        "",
        "| independent bursts (gamma CV 4) | seed | fleet goodput /s | quota moves | "
        + " | ".join(f"{m} attain" for m in MODELS)
        + " |",
        "|---|---|---|---|" + "---|" * len(MODELS),
    ]
    for seed, arms in res["independent"]["seeds"].items():
        for name, a in arms.items():
            lines.append(
                f"| {name} | {seed} | {a['fleet_goodput_rps']:.1f} | {a['quota_moves']} | "
                + " | ".join(f"{a['models'][m]['attainment']:.4f}" for m in MODELS)
                + " |"
            )
    ind = res["independent"]
    lines.append(
        f"\nbroker at least the static split's attainment on every model, on every seed (the target): "
        f"{t['independent_never_worse']}"
    )
    if "moves_never_cost" in ind:  # beside it (not targets): the quota moves alone, and each model over the seeds
        lines.append(
            f"broker at least broker-fixed (its quota moves never cost) on every model and seed: {ind['moves_never_cost']}; "
            f"requests within SLO summed over the seeds at least the static split's on every model: "
            f"{ind['summed_never_worse']}"
        )
    for x in t["independent_short"]:
        lines.append(
            f"- seed {x['seed']} {x['model']}: broker {x['broker']:.4f} < static split {x['static_split']:.4f} "
            f"(broker-fixed, no quota moves: {x['broker_fixed']:.4f})"
        )
    return "\n".join(lines)
