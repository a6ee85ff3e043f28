"""``python -m bench seed``: the knees of static 8, the broker and BentoML at one cap 1.2·S (static 8 at S beside)."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench import scenarios as sc
from bench.live_runs import (
    Opts,
    Workload,
    fleet_target,
    minilm_workload,
    peer_max_latency_ms,
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


def search(o: Opts, run: Any, start: float, label: str) -> tuple[float, list[dict[str, Any]]]:
    """One arm's knee on seed 0, with the search every arm gets (``o.search``)."""
    return sc.live_knee(
        run,
        start,
        step=o.search.step,
        bisect_iters=o.search.bisect_iters,
        max_runs=o.search.max_runs or 12,
        on_row=say_row(o, label),
    )


def arm_doc(o: Opts, knee_rps: float, rows: list[dict[str, Any]], cap_ms: float) -> dict[str, Any]:
    """What an arm's result records besides its knee: its cap, the rules and the search it ran under."""
    return {
        "knee_rps": knee_rps,
        "cap_ms": cap_ms,
        "rules": o.rules.to_dict(),
        "search": o.search.to_dict(),
        "rows": rows,
    }


_STATIC: dict[float, Any] = {}  # cap -> the static 8 fleet deployed with its deadline (one at a time)


def _static_run(stack: sc.Stack, w: Workload, o: Opts, cap_ms: float) -> Any:
    """A run of static 8 (wait 10 ms, scaled) under ``cap_ms``, on a fleet deployed with that cap's
    deadline; the fleet of another cap is taken down first."""
    for c in [c for c in _STATIC if c != cap_ms]:
        _STATIC.pop(c).delete()
    if cap_ms not in _STATIC:
        spec = w.static_spec(cap_ms, 8, w.static_wait_ms, o.rules)
        _STATIC[cap_ms] = fleet_target(stack, {w.model: spec}, "s8c", {w.model: w.body})
    st = _STATIC[cap_ms]
    return lambda r, s: run_arm(st, w.model, r, s, cap_ms, o, w.body)


def static8_knee(stack: sc.Stack, w: Workload, o: Opts, cap_ms: float, ref: float, label: str) -> tuple[float, list]:
    """Static 8's knee on seed 0 under ``cap_ms``, from the reference rate."""
    run = _static_run(stack, w, o, cap_ms)
    k, rows = search(o, lambda r: run(r, 0), ref, label)
    o.log(f"[seed] {label} knee: {k:.1f}/s" if k > 0 else f"[seed] {label}: no rate passed in {len(rows)} runs")
    return k, rows


def seed_one(stack: sc.Stack, w: Workload, o: Opts) -> dict[str, Any]:
    """Knees of static 8 and the broker (and BentoML) at the same cap 1.2·S (the headline), static
    8 at S beside them (the variant), next to the bound; every arm under ``o.rules`` and ``o.search``.

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
    finally:
        st.delete()
    # static 8 at S and at 1.2·S, each deployed with the deadline of its cap (ArmRules)
    try:
        k8s, rows8s = static8_knee(stack, w, o, s_ms, ref, "static 8 at S")
        out["static8_at_S"] = arm_doc(o, k8s, rows8s, s_ms)
        k8s = hold(out["static8_at_S"], lambda r, s: _static_run(stack, w, o, s_ms)(r, s), o, "static 8 at S")
        k8, rows8 = static8_knee(stack, w, o, cap, ref, "static 8 at 1.2·S")
        out["static8"] = arm_doc(o, k8, rows8, cap)
        k8 = hold(out["static8"], lambda r, s: _static_run(stack, w, o, cap)(r, s), o, "static 8 at 1.2·S")
    finally:
        for c in list(_STATIC):
            _STATIC.pop(c).delete()
    fits = pooled_fit(rows8, w.model)
    bd = bound(a_ms, c_req, cap)
    start = max(ref, 0.5 * bd)
    bspec = w.spec(cap, o.rules)
    bspec["batch"]["initial"] = 8 * w.tokens if w.kind == "minilm" else 8  # start where static 8 is
    br = fleet_target(stack, {w.model: bspec}, "brk", warm)
    try:
        # the app stays up across the search: the broker follows each new rate (warm-up o.warmup_s)
        kb, rowsb = search(o, lambda r: run_arm(br, w.model, r, 0, cap, o, w.body), start, "broker")
        out["broker"] = arm_doc(o, kb, rowsb, cap)
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
            "gain": kb / k8 if kb and k8 else None,  # the headline: both at 1.2·S
            "gain_vs_static8_at_S": kb / k8s if kb and k8s else None,  # the variant: static 8 at S
            "broker_vs_bound": kb / bd if kb and bd else None,
        }
    )
    if o.peer:
        try:
            p = start_peer(stack, w, cap, 128, o)
            try:
                # from the broker's knee (the two are close on this stack): fewer runs to bracket it
                kp, rowsp = search(o, lambda r: run_arm(p, w.model, r, 0, cap, o, w.body), kb or start, "bentoml")
                out["bentoml"] = {
                    **arm_doc(o, kp, rowsp, cap),
                    "max_batch_size": 128,
                    "max_latency_ms": peer_max_latency_ms(cap, o.rules),
                }
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
    res: dict[str, Any] = {
        "scenario": "seed",
        "machine": sc.machine_info(),
        "time_scale": o.time_scale,
        "seeds": list(o.seeds),
        "results": [],
    }
    with sc.Stack(direct_ingress=o.direct) as stack:
        for m in models:
            w = profiled_workload(o.time_scale) if m == "profiled" else minilm_workload()
            res["results"].append(seed_one(stack, w, o))
    return res
