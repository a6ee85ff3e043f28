"""``python -m bench oracle`` and ``oracle-knee``: the broker against the best static arms.

The static grid (``screen_arms``: batch x wait x formation, Ray's eager one and the lazy gate, as
the simulator's oracle) is screened in the simulator (``screen_grid``, ``screen_knees``); only the
best candidates run live beside the broker.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from bench import scenarios as sc
from bench.live_runs import Opts, Workload, fleet_target, measured_reference, profiled_workload, run_arm, say_row
from gpubroker.sim.knee import OracleGrid
from gpubroker.sim.types import Arm

GRID_BATCHES = (8, 16, 32, 64, 128)
GRID_WAITS_MS = (0.0, 5.0, 10.0, 20.0, 30.0, 50.0)  # BENCHMARK's 0-20 ms plus 30, 50 (eager batching needs them)
GRID_GATES = OracleGrid().gates  # the simulator oracle's formations: Ray's eager one (False) and the lazy gate (True)
HTTP_MS = 50.0  # what the Serve HTTP path adds on 2 cores (client P95 - replica P95), kept out of the screen's cap


def screen_arms(k: float) -> list[Arm]:
    """The static grid both live oracles screen: GRID_BATCHES x GRID_WAITS_MS (slowed by the time
    scale ``k``) x GRID_GATES: ``static:B:W`` with Ray's eager formation and ``static:B:W:gate`` with
    the replica's lazy gate in front, each its own arm, as in the simulator's oracle."""
    return [Arm("static", b, w * k, gated) for gated in GRID_GATES for b in GRID_BATCHES for w in GRID_WAITS_MS]


def candidate(arm: Arm, **sim: float) -> dict[str, Any]:
    """A screened arm as the live runs take it: its label, batch, wait and formation, and the screen's figures."""
    return {"arm": arm.label, "batch": arm.batch, "wait_ms": arm.wait_ms, "gated": arm.gated, **sim}


def _tie_order(arm: Arm) -> tuple[int, float, bool]:
    """Among equal results: the smallest batch, then the shortest wait, then Ray's formation."""
    return arm.batch, arm.wait_ms, arm.gated


def screen_grid(w: Workload, cap_ms: float, rates: list[float], top: int, o: Opts) -> dict[float, list[dict[str, Any]]]:
    """The static grid (``screen_arms``) run in the simulator at each rate (Ray 2.60's eager
    batching, with the lazy gate in front for a gated arm; the same L(b) as the emulation; cap less
    the HTTP path): the ``top`` arms by goodput (then P95), one per distinct result (``_tie_order``
    among ties). The whole grid live would take hours on 2 cores; the live sweep runs these."""
    from gpubroker.quotas.config import parse_config_text
    from gpubroker.sim.knee import RunSettings, run_at

    cfg = parse_config_text(sc.fleet_yaml({w.model: w.spec(cap_ms - HTTP_MS)}, broker_name="screen"))
    rs = RunSettings(duration_s=60.0, warmup_s=5.0, drain_s=2.0, seed=0, batching="eager")
    out: dict[float, list[dict[str, Any]]] = {}
    for r in rates:
        scored = []
        for arm in screen_arms(o.time_scale):
            m = run_at(cfg, arm, r, rs).models[w.model]
            p95 = m.p95_ms if m.p95_ms is not None else float("inf")
            scored.append(((-round(m.goodput_rps, 2), round(p95)), arm))
        scored.sort(key=lambda t: (t[0], _tie_order(t[1])))
        picked, seen = [], set()
        for (g, p95), arm in scored:
            if (g, p95) in seen:
                continue
            seen.add((g, p95))
            picked.append(candidate(arm, sim_goodput_rps=-g, sim_p95_ms=p95))
            if len(picked) == top:
                break
        out[r] = picked
    return out


def run_static(
    stack: sc.Stack,
    w: Workload,
    cap_ms: float,
    o: Opts,
    cands: list[dict[str, Any]],
    run: Callable[[sc.FleetTarget, dict[str, Any]], None],
) -> None:
    """``run(target, candidate)`` for every static candidate, on one static-pinned fleet per
    formation (a gated one deployed as ``bench.gated_static.GatedStaticModel``), pinned live to
    each candidate by ``set_static``; one formation's fleet is gone before the next one starts."""
    from bench.gated_static import GatedStaticModel

    for gated in GRID_GATES:
        group = [c for c in cands if c["gated"] == gated]
        if not group:
            continue
        spec = w.static_spec(cap_ms, group[0]["batch"], group[0]["wait_ms"], o.rules)
        tag, cls = ("static-gate", GatedStaticModel) if gated else ("static", None)
        st = fleet_target(stack, {w.model: spec}, tag, {w.model: w.body}, model_cls=cls)
        try:
            for c in group:
                st.set_static({w.model: (c["batch"], c["wait_ms"])})
                run(st, c)
        finally:
            st.delete()


def oracle(o: Opts) -> dict[str, Any]:
    """Broker goodput / best static goodput at each rate of a sweep, at cap 1.2·S.

    The static grid is batch 8..128 x wait 0, 5, 10, 20, 30, 50 ms (x time scale; with eager
    batching a static arm's batch is 1 + rate x wait, so only long waits form big batches) x
    formation (Ray's eager one, and the lazy gate in front of it: ``screen_arms``).
    Every grid point is run in the simulator at each rate and the best ``top`` candidates are
    run live beside the broker (``screen_grid``). The broker runs every seed; the ratio pairs
    its seed-0 run with the static candidates' (same arrivals). Since no static arm completes
    more requests than were offered, the broker's attainment at a rate is also a lower bound
    of its oracle ratio there, whatever arm the screen missed."""
    w = profiled_workload(o.time_scale)
    k = o.time_scale
    ref_doc = measured_reference(o, w)
    cap = 1.2 * ref_doc["S_ms"]
    ref = ref_doc["reference_rps"]
    mults = (1.0, 5.0, 10.0) if o.quick else (1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0)
    top = 1 if o.quick else 2
    o = Opts(
        **{**o.__dict__, "min_requests": 150 if not o.quick else 100, "max_window_s": 20.0 if not o.quick else 12.0}
    )
    rates = [ref * m for m in mults]
    o.log(f"[oracle] reference {ref:.2f}/s, cap 1.2·S {cap:.0f} ms; screening the static grid in the simulator")
    cands = screen_grid(w, cap, rates, top, o)
    res: dict[str, Any] = {
        "scenario": "oracle",
        "rules": o.rules.to_dict(),
        "search": o.search.to_dict(),
        "machine": sc.machine_info(),
        "workload": w.label,
        "cap_ms": cap,
        "reference_rps": ref,
        "reference": ref_doc,
        "time_scale": k,
        "grid": [arm.label for arm in screen_arms(k)],
        "screen": {f"{r:.3f}": c for r, c in cands.items()},
        "rates": [],
    }
    warm = {w.model: w.body}
    with sc.Stack(direct_ingress=o.direct) as stack:
        br = fleet_target(stack, {w.model: w.spec(cap, o.rules)}, "brk", warm)
        try:
            broker_rows: dict[float, list[sc.Measurement]] = {}
            for r in rates:
                broker_rows[r] = [run_arm(br, w.model, r, s, cap, o, w.body) for s in o.seeds]
                for m in broker_rows[r]:
                    say_row(o, f"broker s{m.seed}")(m.row())
        finally:
            br.delete()
        arms: dict[str, tuple[dict[str, Any], list[float]]] = {}  # label: (candidate, its rates)
        for r in rates:
            for c in cands[r]:
                arms.setdefault(c["arm"], (c, []))[1].append(r)
        static_rows: dict[float, dict[str, sc.Measurement]] = {r: {} for r in rates}

        def at_its_rates(st: sc.FleetTarget, c: dict[str, Any]) -> None:
            for r in arms[c["arm"]][1]:
                m = run_arm(st, w.model, r, o.seeds[0], cap, o, w.body)
                static_rows[r][c["arm"]] = m
                say_row(o, c["arm"])(m.row())

        run_static(stack, w, cap, o, [c for c, _ in arms.values()], at_its_rates)
    for r in rates:
        b0m = broker_rows[r][0]
        gb = b0m.goodput_rps
        statics = {arm: m.goodput_rps for arm, m in static_rows[r].items()}
        best_arm = max(statics, key=lambda a: (statics[a], -(static_rows[r][a].summary[w.model].p95_ms or 1e9)))
        atts = [m.summary[w.model].attainment for m in broker_rows[r]]
        res["rates"].append(
            {
                "rate_rps": r,
                "broker_goodput_rps": gb,
                "broker_attainment": atts[0],
                "broker_attainment_seeds": atts,
                "broker_goodput_seeds": [m.goodput_rps for m in broker_rows[r]],
                "broker_p95_ms": b0m.summary[w.model].p95_ms,
                "broker_p95_seeds_ms": [m.summary[w.model].p95_ms for m in broker_rows[r]],
                "broker_mean_batch": b0m.batch[w.model]["mean_batch"],
                "broker_settings": b0m.extra.get("settings"),
                "broker_decisions": b0m.extra.get("decisions"),
                "static_goodput_rps": statics,
                "best_static": best_arm,
                "best_static_goodput_rps": statics[best_arm],
                "oracle_ratio": gb / statics[best_arm] if statics[best_arm] > 0 else None,
                "oracle_ratio_floor": min(atts),
                "static_p95_ms": {arm: m.summary[w.model].p95_ms for arm, m in static_rows[r].items()},
                "static_attainment": {arm: m.summary[w.model].attainment for arm, m in static_rows[r].items()},
            }
        )
        o.log(
            f"[oracle] {r:6.1f}/s  broker {gb:6.1f}/s  best {best_arm} {statics[best_arm]:6.1f}/s  "
            f"ratio {res['rates'][-1]['oracle_ratio']}  broker attainment over seeds {min(atts):.3f}..{max(atts):.3f}"
        )
    return res


def screen_knees(w: Workload, cap_ms: float, start_rps: float, top: int, o: Opts) -> list[dict[str, Any]]:
    """Every static grid arm's knee (``screen_arms``: both formations) at ``cap_ms`` in the
    simulator (eager batching, the gate in front for a gated arm, the cap less the HTTP path): the
    ``top`` arms with the highest knees, the candidates ``oracle-knee`` searches live. (Ranking by
    goodput at one overloaded rate would favour arms whose waits alone exceed the cap.)"""
    from gpubroker.quotas.config import parse_config_text
    from gpubroker.sim.knee import RunSettings, Search, knee

    cfg = parse_config_text(sc.fleet_yaml({w.model: w.spec(cap_ms - HTTP_MS)}, broker_name="screen"))
    rs = RunSettings(duration_s=60.0, warmup_s=5.0, drain_s=2.0, seed=0, batching="eager")
    scored = []
    for arm in screen_arms(o.time_scale):
        kn = knee(cfg, arm, 0.5 * start_rps, rs, search=Search(step=1.2, bisect_iters=3)).knee_rps
        scored.append((-round(kn, 2), arm))
    scored.sort(key=lambda t: (t[0], _tie_order(t[1])))
    picked, seen = [], set()
    for kn, arm in scored:  # one arm per distinct knee: bigger caps the wait never fills tie
        if kn in seen:
            continue
        seen.add(kn)
        picked.append(candidate(arm, sim_knee_rps=-kn))
        if len(picked) == top:
            break
    return picked


def oracle_knee(o: Opts) -> dict[str, Any]:
    """λ_max at cap 1.2·S of the static arms with the highest knees in the simulator
    (``screen_knees`` over the whole grid), each searched live from the broker's knee: the live
    oracle knee over those arms, next to the broker's knee from the `seed` result
    (BENCHMARK.md: the broker must reach 0.9 of it)."""
    w = profiled_workload(o.time_scale)
    ref_doc = measured_reference(o, w)
    cap = 1.2 * ref_doc["S_ms"]
    start = ref_doc["reference_rps"] * 10.0
    try:
        seed_doc = json.loads(open(o.seed_json, encoding="utf-8").read()) if o.seed_json else {}
        broker_knee = next(
            (r["broker"]["knee_rps"] for r in seed_doc.get("results", []) if r.get("workload") == w.label), None
        )
    except (OSError, ValueError, KeyError):
        broker_knee = None
    if broker_knee:
        start = broker_knee
    top = 2 if o.quick else 3
    cands = screen_knees(w, cap, start, top, o)
    o.log(
        f"[oracle-knee] cap 1.2·S {cap:.0f} ms; the simulator's highest static knees: "
        + ", ".join(f"{c['arm']} ({c['sim_knee_rps']:.1f}/s)" for c in cands)
    )
    res: dict[str, Any] = {
        "scenario": "oracle-knee",
        "rules": o.rules.to_dict(),
        "search": o.search.to_dict(),
        "machine": sc.machine_info(),
        "workload": w.label,
        "cap_ms": cap,
        "reference": ref_doc,
        "time_scale": o.time_scale,
        "broker_knee_rps": broker_knee,
        "screen_rate_rps": start,
        "screen": cands,
        "arms": [],
    }

    def search(st: sc.FleetTarget, c: dict[str, Any]) -> None:
        kn, rows = sc.live_knee(
            lambda r: run_arm(st, w.model, r, 0, cap, o, w.body),
            start,
            step=o.search.step,
            bisect_iters=o.search.bisect_iters,
            max_runs=o.search.max_runs or 12,
            on_row=say_row(o, c["arm"]),
        )
        res["arms"].append({"arm": c["arm"], "knee_rps": kn, "rows": rows})
        o.log(f"[oracle-knee] {c['arm']} knee at 1.2·S: {kn:.1f}/s")

    with sc.Stack(direct_ingress=o.direct) as stack:
        run_static(stack, w, cap, o, cands, search)
    best = max(res["arms"], key=lambda a: a["knee_rps"])
    res["oracle_knee_rps"], res["oracle_arm"] = best["knee_rps"], best["arm"]
    res["broker_vs_oracle"] = broker_knee / best["knee_rps"] if broker_knee and best["knee_rps"] else None
    return res
