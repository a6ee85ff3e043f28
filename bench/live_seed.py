"""``gpubroker bench seed``: static 8's knee at S against the broker's (and BentoML's) at 1.2·S."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench import scenarios as sc
from bench.live_runs import (
    Opts,
    Workload,
    fleet_target,
    minilm_workload,
    pooled_fit,
    profiled_workload,
    run_arm,
    say_row,
    start_peer,
)
from gpubroker.sim.knee import HELD_BISECT, HOLD_RUNS_PER_SEED, bound, bound_batch, held_search


def hold(doc: dict[str, Any], run: Any, o: Opts, label: str) -> float | None:
    """The knee that holds on every seed (``gpubroker.sim.knee.held_search``): searched down from seed
    0's (``doc["knee_rps"]``); ``doc`` keeps seed 0's as ``seed0_knee_rps``, the held one as
    ``knee_rps`` and the other seeds' runs as ``seeds_at_knee``. Returns the held knee, or None
    when the budget ran out before a rate held (``held_resolved`` False, ``held_below_rps``:
    no rate above it held; ``knee_rps`` is then None, not 0)."""
    k0 = doc["knee_rps"]
    doc["seed0_knee_rps"] = k0
    if len(o.seeds) < 2 or k0 <= 0:
        return k0
    rows: list[dict[str, Any]] = []

    def passes(rate: float, seed: int) -> bool:
        m = run(rate, seed)
        rows.append(m.row())
        say_row(o, f"{label} s{seed}")(rows[-1])
        return m.passes

    held = held_search(passes, k0, o.seeds, max_runs=HOLD_RUNS_PER_SEED * len(o.seeds), bisect_iters=HELD_BISECT)
    doc.update(
        knee_rps=held.rate if held.resolved else None,
        seeds_at_knee=rows,
        held_resolved=held.resolved,
        held_below_rps=held.below_rps,
    )
    if held.resolved:
        o.log(f"[seed] {label} knee held on seeds {list(o.seeds)}: {held.rate:.1f}/s (seed 0: {k0:.1f}/s)")
        return held.rate
    o.log(
        f"[seed] {label} knee not held within {held.runs} runs: none held above {held.below_rps:.1f}/s "
        f"(seed 0: {k0:.1f}/s)"
    )
    return None


def seed_one(stack: sc.Stack, w: Workload, o: Opts) -> dict[str, Any]:
    """Knee of static 8 at cap S vs the broker (and BentoML) at cap 1.2·S, next to the bound.

    Budget (2 cores: a full run of both workloads must finish in 15 minutes, ``--quick`` in 3):
    every search starts where a model puts the knee, so a few runs bracket it. Static 8's
    saturation starts at the eager-batching model's estimate; the broker's and BentoML's knees
    start at half the bound (1 − 2a/C)/c (measured knees sit at 0.55–0.7 of it). ``--quick``
    takes the reference rate from the eager model instead of measuring static 8's saturation
    and skips the peer unless asked for."""
    out: dict[str, Any] = {"workload": w.label, "emulated": w.emulated}
    warm = {w.model: w.body}
    q = o.quick
    # static 8 (pinned, broker-managed deployment), wait 10 ms (scaled)
    st = fleet_target(stack, {w.model: w.static_spec(10_000, 8, w.static_wait_ms)}, "s8", warm)
    try:
        if w.a_ms is None:  # fit a, c first (batches 1..8 at a light load)
            cal = run_arm(st, w.model, 8.0, 99, 10_000, o, w.body)
            f = cal.batch[w.model]
            out["calibration"] = f
            a_ms, c_tok = f["fit_a_ms"] or 1.0, f["fit_c_ms"] or 0.01
            c_req = c_tok * w.tokens if w.kind == "minilm" else c_tok
        else:
            a_ms, c_req = w.a_ms, w.c_ms
        # Static 8's saturation. Lazy (a batch grows while the replica is busy): 8/(a + 8c).
        # Ray 2.60 forms batches eagerly (1 + rate x wait, at most 8), so the arm saturates far
        # lower; the reference rate is half of the MEASURED saturation: the largest rate static
        # 8 sustains at all, i.e. its knee under a loose cap (8 x L(8)).
        sat_lazy = 8000.0 / (a_ms + 8 * c_req)
        sat_model = sc.eager_saturation(8, w.static_wait_ms, a_ms, c_req)
        loose = 8.0 * (a_ms + 8 * c_req)
        rows_sat: list[dict[str, Any]] = []
        if q:
            sat8 = sat_model
            o.log(
                f"[seed] {w.label}: a={a_ms:.2f} c={c_req:.3f} ms/request; --quick: static 8 saturation from the "
                f"eager model {sat_model:.1f}/s (lazy {sat_lazy:.1f}/s), not measured"
            )
        else:
            o.log(
                f"[seed] {w.label}: a={a_ms:.2f} c={c_req:.3f} ms/request; static 8 saturation: lazy {sat_lazy:.1f}/s, "
                f"eager model {sat_model:.1f}/s; measuring it live (loose cap {loose:.0f} ms)"
            )
            # from under the model's estimate, 10 % steps, three runs; real compute (MiniLM)
            # shares the 2 CPUs with the HTTP path, so there the model is further off (measured
            # 32/s against 43/s): an overloaded run costs twice a passing one
            start_sat = (0.9 if w.emulated else 0.75) * sat_model
            ksat, rows_sat = sc.live_knee(
                lambda r: run_arm(st, w.model, r, 0, loose, o, w.body),
                start_sat,
                step=1.1,
                bisect_iters=0,
                max_runs=3,
                on_row=say_row(o, "static 8 sat"),
            )
            sat8 = ksat if ksat > 0 else sat_model
        ref = 0.5 * sat8
        s_runs = [run_arm(st, w.model, ref, s, 10_000, o, w.body) for s in o.seeds]
        s_ms = float(np.median([m.summary[w.model].p95_ms for m in s_runs]))
        cap = 1.2 * s_ms
        o.log(
            f"[seed] static-8 saturation {sat8:.1f}/s ({'model' if q else 'measured'}; lazy bound {sat_lazy:.1f}/s), "
            f"reference {ref:.1f}/s, S = {s_ms:.0f} ms, cap 1.2·S = {cap:.0f} ms"
        )
        out.update(
            {
                "a_nominal_ms": a_ms,
                "c_nominal_ms": c_req,
                "static8_saturation_rps": sat8,
                "static8_saturation_measured": not q,
                "static8_saturation_lazy_rps": sat_lazy,
                "static8_saturation_eager_model_rps": sat_model,
                "saturation_loose_cap_ms": loose,
                "saturation_rows": rows_sat,
                "reference_rps": ref,
                "reference_lazy_rps": 0.5 * sat_lazy,
                "S_ms": s_ms,
                "cap_ms": cap,
                "S_rows": [m.row() for m in s_runs],
            }
        )
        # S is static 8's P95 at the reference, so its knee under S sits near the reference; its
        # P95 barely falls below it (Ray's eager batches of 1-2 at any rate there), so a seed-0
        # draw above S at the reference can fail for several 10 % steps down: 5 runs, not 3
        k8, rows8 = sc.live_knee(
            lambda r: run_arm(st, w.model, r, 0, s_ms, o, w.body),
            ref,
            step=1.1,
            bisect_iters=0 if q else 1,
            max_runs=2 if q else 5,
            on_row=say_row(o, "static 8"),
        )
        out["static8"] = {"knee_rps": k8, "rows": rows8}
        if k8 > 0:
            o.log(f"[seed] static 8 knee at S: {k8:.1f}/s")
        else:
            tried = ", ".join(f"{r['rate']:.2f}/s P95 {r['models'][w.model]['p95_ms']:.0f} ms" for r in rows8)
            o.log(f"[seed] static 8: no rate passed under S = {s_ms:.0f} ms in {len(rows8)} runs ({tried}); no gain")
        k8 = hold(out["static8"], lambda r, s: run_arm(st, w.model, r, s, s_ms, o, w.body), o, "static 8")
    finally:
        st.delete()
    fits = pooled_fit(rows8, w.model)
    bd = bound(a_ms, c_req, cap)
    start = max(ref, 0.5 * bd)
    bspec = w.spec(cap)
    bspec["batch"]["initial"] = 8 * w.tokens if w.kind == "minilm" else 8  # start where static 8 is
    br = fleet_target(stack, {w.model: bspec}, "brk", warm)
    try:
        # the app stays up across the search: the broker follows each new rate (warm-up o.warmup_s)
        kb, rowsb = sc.live_knee(
            lambda r: run_arm(br, w.model, r, 0, cap, o, w.body),
            start,
            step=1.2 if q else 1.15,
            bisect_iters=1 if q else 2,
            max_runs=4 if q else 6,
            on_row=say_row(o, "broker"),
        )
        out["broker"] = {"knee_rps": kb, "rows": rowsb}
        o.log(f"[seed] broker knee at 1.2·S: {kb:.1f}/s (bound {bd:.1f}/s)")
        kb = hold(out["broker"], lambda r, s: run_arm(br, w.model, r, s, cap, o, w.body), o, "broker")
    finally:
        br.delete()
    fitb = pooled_fit(rowsb, w.model)
    out["fit_static8"], out["fit_broker"] = fits, fitb
    a_fit = fitb["a_ms"] if fitb["a_ms"] is not None else a_ms
    c_fit = fitb["c_ms"] if fitb["c_ms"] is not None else c_req
    if w.kind == "minilm" and fitb["c_ms"] is not None:
        c_fit = fitb["c_ms"] * w.tokens
    out.update(
        {
            "bound_rps": bd,
            "bound_batch": bound_batch(a_ms, c_req, cap),
            "bound_fitted_rps": bound(a_fit, c_fit, cap),
            "gain": kb / k8 if kb and k8 else None,
            "broker_vs_bound": kb / bd if kb and bd else None,
        }
    )
    if o.peer:
        try:
            p = start_peer(stack, w, cap, 128, o)
            try:
                # from the broker's knee (the two are close on this stack): fewer runs to bracket it
                kp, rowsp = sc.live_knee(
                    lambda r: run_arm(p, w.model, r, 0, cap, o, w.body),
                    kb or start,
                    step=1.1,
                    bisect_iters=1,
                    max_runs=4 if q else 5,
                    on_row=say_row(o, "bentoml"),
                )
                out["bentoml"] = {"knee_rps": kp, "rows": rowsp, "max_batch_size": 128, "max_latency_ms": cap}
                kp = hold(out["bentoml"], lambda r, s: run_arm(p, w.model, r, s, cap, o, w.body), o, "bentoml")
                out["broker_vs_bentoml"] = kb / kp if kb and kp else None
                o.log(f"[seed] BentoML knee at 1.2·S: {'not held' if kp is None else f'{kp:.1f}/s'}")
            finally:
                p.delete()
        except Exception as exc:  # noqa: BLE001 - the peer is optional; say why it is missing
            out["bentoml"] = {"error": repr(exc)[:400]}
            o.log(f"[seed] BentoML peer failed: {exc!r}")
    return out


def seed(o: Opts, models: tuple[str, ...] | None = None) -> dict[str, Any]:
    models = models or (("profiled",) if o.quick else ("profiled", "minilm"))
    res: dict[str, Any] = {"scenario": "seed", "machine": sc.machine_info(), "time_scale": o.time_scale, "results": []}
    with sc.Stack(direct_ingress=o.direct) as stack:
        for m in models:
            w = profiled_workload(o.time_scale) if m == "profiled" else minilm_workload()
            res["results"].append(seed_one(stack, w, o))
    return res
