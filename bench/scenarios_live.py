"""The live-stack scenarios of ``gpubroker bench``: seed, oracle, burst, overhead, trace.

Every scenario starts its own Ray + Serve (``bench.scenarios.Stack``), deploys one app per
arm, runs open-loop HTTP load (``bench.loadgen``) and tears everything down. Arms compared
in one scenario see the same arrivals (same seed) and run side by side in one process, so
their *ratios* are the result; absolute numbers on a shared 2-core machine are noisy.

Time scale. On a 2-core host the Serve HTTP path (proxy, ingress, replica, client) tops out
near 100 req/s, well under the a=20 ms / c=0.5 ms profile's knee (~455/s). The ``profiled``
emulation is therefore run slowed down by ``time_scale`` k (default 10: a=200 ms, c=5 ms,
and the static arm's 10 ms wait becomes 100 ms): rates fall by k and every ratio the
benchmark reports (knee gain, oracle ratio, knee/bound) is unchanged by the scale. It is an
EMULATION (``profiled`` sleeps a + c·b) and the tables say so; MiniLM is real compute.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from bench import arrivals as arr
from bench import loadgen as lg
from bench import scenarios as sc
from bench.knee import bound, bound_batch
from bench.tagged import TAGGED


@dataclass
class Opts:
    quick: bool = False
    time_scale: float = 10.0
    seeds: tuple[int, ...] = (0, 1, 2)
    duration_s: float = 24.0  # fixed-length runs (oracle, overhead, trace)
    warmup_s: float = 5.0  # dropped from the front of each run: the broker (or BentoML) adapts to the new rate
    static_warmup_s: float = 2.0  # a static arm only needs its pipeline filled
    cooldown_s: float = 1.0
    # Knee runs size their measured window by the rate: at least min_requests in it, within
    # [min_window_s, max_window_s] (a P95 needs ~100+ samples; a fast arm needs only seconds).
    min_requests: int = 180
    min_window_s: float = 8.0
    max_window_s: float = 20.0
    peer: bool = True
    arrivals: str = "poisson"  # knee and sweep runs: poisson, or gamma:CV (bursty, BENCHMARK.md's CV 2 and 4)
    seed_json: str | None = None  # a `bench seed` result: oracle and trace take its measured S and reference
    log: Callable[[str], None] = print
    out: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, quick: bool, **kw: Any) -> "Opts":
        if quick:
            return cls(quick=True, seeds=(0,), duration_s=12.0, warmup_s=4.0, static_warmup_s=1.5, cooldown_s=0.5,
                       min_requests=100, min_window_s=5.0, max_window_s=16.0, **kw)
        return cls(quick=False, **kw)


def _timeouts(cap_ms: float) -> tuple[float, float]:
    """(replica request_timeout_s, client timeout_s): a request 5 caps late is a miss anyway."""
    rt = max(2.0, 5.0 * cap_ms / 1000.0)
    return rt, rt + 3.0


def run_length(o: Opts, rate: float, adaptive: bool) -> tuple[float, float]:
    """(warm-up, duration) of one run at ``rate``: the measured window holds at least
    ``o.min_requests`` arrivals, within [min_window_s, max_window_s]. A static arm (``adaptive``
    False) needs a shorter warm-up than the broker or BentoML, which adapt to each new rate."""
    warm = o.warmup_s if adaptive else min(o.warmup_s, o.static_warmup_s)
    window = min(o.max_window_s, max(o.min_window_s, o.min_requests / max(rate, 1e-6)))
    return warm, warm + window + o.cooldown_s


def parse_arrivals(spec: str) -> float | None:
    """``poisson`` -> None; ``gamma:CV`` -> CV (> 0). Anything else: ValueError naming the fix."""
    if spec == "poisson":
        return None
    kind, _, cv = spec.partition(":")
    try:
        if kind == "gamma" and float(cv) > 0:
            return float(cv)
    except ValueError:
        pass
    raise ValueError(f"--arrivals {spec!r}: use 'poisson' or 'gamma:CV' with CV > 0 (e.g. gamma:2, gamma:4)")


def draw_arrivals(spec: str, rate: float, duration_s: float, seed: int) -> np.ndarray:
    cv = parse_arrivals(spec)
    return arr.poisson(rate, duration_s, seed) if cv is None else arr.gamma(rate, duration_s, cv, seed)


def knee_arrivals(o: Opts, rate: float, seed: int, adaptive: bool) -> tuple[np.ndarray, float, float]:
    """(arrival times, warm-up, duration) of a knee run. Every arm draws the same arrivals for
    (rate, seed): a static arm's shorter warm-up drops the front of the adaptive arms'
    schedule, so the measured windows of both hold the same requests."""
    warm, duration = run_length(o, rate, adaptive)
    shift = o.warmup_s - warm
    times = draw_arrivals(o.arrivals, rate, duration + shift, seed)
    return times[times >= shift] - shift, warm, duration


def _run(target: Any, model: str, rate: float, seed: int, cap_ms: float, o: Opts, body: bytes,
         times: np.ndarray | None = None, tokens: np.ndarray | None = None, bodyf: Callable[[int], bytes] | None = None,
         fixed: bool = False) -> sc.Measurement:
    """One run at ``rate``. Knee runs size their window by the rate (``run_length``); ``fixed``
    runs (and given ``times``) use ``o.duration_s`` / ``o.warmup_s`` as they are."""
    if hasattr(target, "idle"):
        target.idle()
    fleet = getattr(target, "kind", "") == "fleet"
    dynamic = fleet and "strategy: static" not in getattr(target, "config_text", "")
    if fixed or times is not None:
        warm, duration = o.warmup_s, o.duration_s
        if times is None:
            times = draw_arrivals(o.arrivals, rate, duration, seed)
    else:
        times, warm, duration = knee_arrivals(o, rate, seed, dynamic or getattr(target, "kind", "") == "bentoml")
    sched = lg.plan(model, times, bodyf or body, tokens)
    _, client_t = _timeouts(cap_ms)
    seq0 = sc.decisions_since(target, 0, model)[1] if dynamic else 0
    m = sc.measure(target, sched, duration, {model: cap_ms}, warmup_s=warm, cooldown_s=o.cooldown_s,
                   rate=rate, seed=seed, poll=fleet, timeout_s=client_t)
    m.extra["window_s"] = round(duration - warm - o.cooldown_s, 2)
    if fleet:  # what the replicas were told during the measured window (status polls)
        m.extra["settings"] = lg.settings_seen(m.status_samples, model, warm, duration - o.cooldown_s)
    if dynamic:  # the broker's own log of what it set and why (GET /v1/decisions)
        m.extra["decisions"] = sc.decisions_since(target, seq0, model)[0][-40:]
    return m


def _say_row(o: Opts, label: str) -> Callable[[dict[str, Any]], None]:
    def f(row: dict[str, Any]) -> None:
        m = next(iter(row["models"].values()))
        st = row.get("settings") or {}
        cap = (st.get("max_batch_size") or {}).get("median")
        wait = (st.get("batch_wait_timeout_s") or {}).get("median")
        told = f"  set cap {cap:g} wait {wait * 1000:.0f} ms" if cap is not None and wait is not None else ""
        o.log(f"  {label:<14} rate {row['rate']:7.2f}/s  {'PASS' if row['pass'] else 'fail'}  P95 {m['p95_ms']} ms "
              f"(cap {m['cap_ms']})  att {m['attainment']:.3f}  batch {None if m['mean_batch'] is None else round(m['mean_batch'], 1)}"
              f"  lag99 {m['send_lag_p99_ms']}{told}  decisions {len(row.get('decisions') or [])}")
    return f


def _fit_from(rows: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """Pool the per-run fits (weighted by batches seen) into one a, c."""
    pts = [(r["models"][model]["fit_a_ms"], r["models"][model]["fit_c_ms"], r["models"][model]["fit_batches"])
           for r in rows if model in r["models"] and r["models"][model].get("fit_a_ms") is not None]
    if not pts:
        return {"a_ms": None, "c_ms": None}
    w = np.array([p[2] for p in pts], dtype=float)
    return {"a_ms": float(np.average([p[0] for p in pts], weights=w)), "c_ms": float(np.average([p[1] for p in pts], weights=w)),
            "batches": int(w.sum())}


# ------------------------------------------------------------------------------ workloads
@dataclass
class Workload:
    """One model under test: how to configure it, what to send, its nominal profile."""

    label: str
    model: str  # name in the fleet
    kind: str  # profiled | minilm
    options: dict[str, Any]
    a_ms: float | None  # nominal per-batch cost (profiled) or None (fitted first)
    c_ms: float | None  # nominal per-request cost
    tokens: int = 1  # tokens per request (minilm)
    static_wait_ms: float = 10.0  # static 8's wait (scaled with the profile)
    emulated: bool = True

    @property
    def body(self) -> bytes:
        return lg.default_body(self.kind, self.tokens)

    @property
    def ref(self) -> str:
        return TAGGED[self.kind]

    def spec(self, cap_ms: float) -> dict[str, Any]:
        rt, _ = _timeouts(cap_ms)
        if self.kind == "minilm":
            s = sc.minilm_spec(cap_ms, ceiling=128 * self.tokens, floor=self.tokens)
        else:
            s = sc.profiled_spec(self.options["a_ms"], self.options["c_ms"], cap_ms)
            s["options"] = dict(self.options)
        s["request_timeout_s"] = rt
        s["wait"]["max_ms"] = max(50.0, 5 * self.static_wait_ms)
        return s

    def static_spec(self, cap_ms: float, batch: int, wait_ms: float) -> dict[str, Any]:
        b = batch * self.tokens if self.kind == "minilm" else batch  # token models: B × request length
        return sc.pin_static(self.spec(cap_ms), b, wait_ms)


def profiled_workload(k: float, a_ms: float = 20.0, c_ms: float = 0.5) -> Workload:
    return Workload(f"profiled a={a_ms:g} c={c_ms:g} (x{k:g} slow: a={a_ms * k:g} c={c_ms * k:g}; EMULATION)", "prof",
                    "profiled", {"a_ms": a_ms * k, "c_ms": c_ms * k, "weights_bytes": 16 * sc.MiB,
                                 "bytes_per_item": 256 * 1024, "unit": "requests"},
                    a_ms * k, c_ms * k, static_wait_ms=10.0 * k)


def minilm_workload(tokens: int = 64) -> Workload:
    return Workload(f"minilm ({tokens} tokens/request, real CPU compute, 1 thread)", "minilm", "minilm",
                    {"threads": 1, "max_tokens": 256}, None, None, tokens=tokens, static_wait_ms=10.0, emulated=False)


def _fleet(stack: sc.Stack, specs: dict[str, dict[str, Any]], tag: str, warm: dict[str, bytes],
           capacity: str = "8GiB") -> sc.FleetTarget:
    text = sc.fleet_yaml(specs, broker_name=f"bench-{tag}-{int(time.time() * 1000) % 10**8}", http_port=stack.port,
                         capacity=capacity)
    return stack.deploy_fleet(text, app=f"fleet-{tag}", warm_models=warm)


def _peer(stack: sc.Stack, w: Workload, cap_ms: float, max_batch: int, o: Opts) -> Any:
    from bench.peer.runner import PeerServer, ensure_venv

    ensure_venv(o.log)
    p = PeerServer(w.ref, w.options, w.model, max_batch, cap_ms, sc.free_port(), log_path="/tmp/gpubroker-bench-peer.log")
    p.wait_ready(json.loads(w.body))
    return p


# ------------------------------------------------------------------------------ seed
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
    st = _fleet(stack, {w.model: w.static_spec(10_000, 8, w.static_wait_ms)}, "s8", warm)
    try:
        if w.a_ms is None:  # fit a, c first (batches 1..8 at a light load)
            cal = _run(st, w.model, 8.0, 99, 10_000, o, w.body)
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
            o.log(f"[seed] {w.label}: a={a_ms:.2f} c={c_req:.3f} ms/request; --quick: static 8 saturation from the "
                  f"eager model {sat_model:.1f}/s (lazy {sat_lazy:.1f}/s), not measured")
        else:
            o.log(f"[seed] {w.label}: a={a_ms:.2f} c={c_req:.3f} ms/request; static 8 saturation: lazy {sat_lazy:.1f}/s, "
                  f"eager model {sat_model:.1f}/s; measuring it live (loose cap {loose:.0f} ms)")
            # from under the model's estimate, 10 % steps, three runs; real compute (MiniLM)
            # shares the 2 CPUs with the HTTP path, so there the model is further off (measured
            # 32/s against 43/s): an overloaded run costs twice a passing one
            start_sat = (0.9 if w.emulated else 0.75) * sat_model
            ksat, rows_sat = sc.live_knee(lambda r: _run(st, w.model, r, 0, loose, o, w.body), start_sat, step=1.1,
                                          bisect_iters=0, max_runs=3, on_row=_say_row(o, "static 8 sat"))
            sat8 = ksat if ksat > 0 else sat_model
        ref = 0.5 * sat8
        s_runs = [_run(st, w.model, ref, s, 10_000, o, w.body) for s in o.seeds]
        s_ms = float(np.median([m.summary[w.model].p95_ms for m in s_runs]))
        cap = 1.2 * s_ms
        o.log(f"[seed] static-8 saturation {sat8:.1f}/s ({'model' if q else 'measured'}; lazy bound {sat_lazy:.1f}/s), "
              f"reference {ref:.1f}/s, S = {s_ms:.0f} ms, cap 1.2·S = {cap:.0f} ms")
        out.update({"a_nominal_ms": a_ms, "c_nominal_ms": c_req, "static8_saturation_rps": sat8,
                    "static8_saturation_measured": not q,
                    "static8_saturation_lazy_rps": sat_lazy, "static8_saturation_eager_model_rps": sat_model,
                    "saturation_loose_cap_ms": loose, "saturation_rows": rows_sat, "reference_rps": ref,
                    "reference_lazy_rps": 0.5 * sat_lazy,
                    "S_ms": s_ms, "cap_ms": cap, "S_rows": [m.row() for m in s_runs]})
        # S is static 8's P95 at the reference, so its knee under S sits near the reference
        k8, rows8 = sc.live_knee(lambda r: _run(st, w.model, r, 0, s_ms, o, w.body), ref, step=1.1,
                                 bisect_iters=0 if q else 1, max_runs=2 if q else 3, on_row=_say_row(o, "static 8"))
        out["static8"] = {"knee_rps": k8, "rows": rows8}
        o.log(f"[seed] static 8 knee at S: {k8:.1f}/s")
        if len(o.seeds) > 1 and k8 > 0:  # the knee again with the other seeds
            out["static8"]["seeds_at_knee"] = [_run(st, w.model, k8, s, s_ms, o, w.body).row() for s in o.seeds[1:]]
    finally:
        st.delete()
    fits = _fit_from(rows8, w.model)
    bd = bound(a_ms, c_req, cap)
    start = max(ref, 0.5 * bd)
    bspec = w.spec(cap)
    bspec["batch"]["initial"] = 8 * w.tokens if w.kind == "minilm" else 8  # start where static 8 is
    br = _fleet(stack, {w.model: bspec}, "brk", warm)
    try:
        # the app stays up across the search: the broker follows each new rate (warm-up o.warmup_s)
        kb, rowsb = sc.live_knee(lambda r: _run(br, w.model, r, 0, cap, o, w.body), start, step=1.2 if q else 1.15,
                                 bisect_iters=1 if q else 2, max_runs=4 if q else 6, on_row=_say_row(o, "broker"))
        out["broker"] = {"knee_rps": kb, "rows": rowsb}
        o.log(f"[seed] broker knee at 1.2·S: {kb:.1f}/s (bound {bd:.1f}/s)")
        if len(o.seeds) > 1 and kb > 0:
            out["broker"]["seeds_at_knee"] = [_run(br, w.model, kb, s, cap, o, w.body).row() for s in o.seeds[1:]]
    finally:
        br.delete()
    fitb = _fit_from(rowsb, w.model)
    out["fit_static8"], out["fit_broker"] = fits, fitb
    a_fit = fitb["a_ms"] if fitb["a_ms"] is not None else a_ms
    c_fit = fitb["c_ms"] if fitb["c_ms"] is not None else c_req
    if w.kind == "minilm" and fitb["c_ms"] is not None:
        c_fit = fitb["c_ms"] * w.tokens
    out.update({"bound_rps": bd, "bound_batch": bound_batch(a_ms, c_req, cap),
                "bound_fitted_rps": bound(a_fit, c_fit, cap), "gain": kb / k8 if k8 else None,
                "broker_vs_bound": kb / bd if bd else None})
    if o.peer:
        try:
            p = _peer(stack, w, cap, 128, o)
            try:
                # from the broker's knee (the two are close on this stack): fewer runs to bracket it
                kp, rowsp = sc.live_knee(lambda r: _run(p, w.model, r, 0, cap, o, w.body), kb if kb > 0 else start,
                                         step=1.1, bisect_iters=1, max_runs=4 if q else 5, on_row=_say_row(o, "bentoml"))
                # one seed (the 15-minute budget): the gain's two knees get the other seeds
                out["bentoml"] = {"knee_rps": kp, "rows": rowsp, "max_batch_size": 128, "max_latency_ms": cap}
                out["broker_vs_bentoml"] = kb / kp if kp else None
                o.log(f"[seed] BentoML knee at 1.2·S: {kp:.1f}/s")
            finally:
                p.delete()
        except Exception as exc:  # noqa: BLE001 - the peer is optional; say why it is missing
            out["bentoml"] = {"error": repr(exc)[:400]}
            o.log(f"[seed] BentoML peer failed: {exc!r}")
    return out


def seed(o: Opts, models: tuple[str, ...] | None = None) -> dict[str, Any]:
    models = models or (("profiled",) if o.quick else ("profiled", "minilm"))
    res: dict[str, Any] = {"scenario": "seed", "machine": sc.machine_info(), "time_scale": o.time_scale, "results": []}
    with sc.Stack() as stack:
        for m in models:
            w = profiled_workload(o.time_scale) if m == "profiled" else minilm_workload()
            res["results"].append(seed_one(stack, w, o))
    return res


# ------------------------------------------------------------------------------ oracle
SIM_S_MS = 50.0  # S of a=20/c=0.5 in the simulator with eager batching (README, "First result")


def measured_reference(o: Opts, w: Workload) -> dict[str, Any]:
    """Reference rate, static 8 saturation and S for the profiled workload: from the `seed`
    result in ``o.seed_json`` when it measured this profile at this time scale, else the
    eager-batching model (saturation of static 8:10) and the simulator's S (50 ms x k)."""
    try:
        doc = json.loads(open(o.seed_json, encoding="utf-8").read()) if o.seed_json else None
    except (OSError, ValueError):
        doc = None
    if doc and float(doc.get("time_scale", -1)) == float(o.time_scale):
        for r in doc.get("results", []):
            if r.get("workload") == w.label and r.get("S_ms"):
                return {"source": f"measured by `bench seed` ({doc.get('machine', {}).get('date')})",
                        "static8_saturation_rps": r["static8_saturation_rps"], "reference_rps": r["reference_rps"],
                        "S_ms": r["S_ms"]}
    sat = sc.eager_saturation(8, w.static_wait_ms, w.a_ms, w.c_ms)
    return {"source": "eager-batching model (no seed result at this time scale)", "static8_saturation_rps": sat,
            "reference_rps": 0.5 * sat, "S_ms": SIM_S_MS * o.time_scale}


GRID_BATCHES = (8, 16, 32, 64, 128)
GRID_WAITS_MS = (0.0, 5.0, 10.0, 20.0, 30.0, 50.0)  # BENCHMARK's 0-20 ms plus 30, 50 (eager batching needs them)
HTTP_MS = 50.0  # what the Serve HTTP path adds on 2 cores (client P95 - replica P95), kept out of the screen's cap


def screen_grid(w: Workload, cap_ms: float, rates: list[float], top: int, o: Opts) -> dict[float, list[dict[str, Any]]]:
    """The static grid (GRID_BATCHES x GRID_WAITS_MS, scaled) run in the simulator at each rate
    (Ray 2.60's eager batching, the same L(b) as the emulation, cap less the HTTP path): the
    ``top`` arms by goodput (then P95), one per distinct result, smallest batch first among ties.
    The whole grid live would take hours on 2 cores; the live sweep runs these candidates."""
    from bench.knee import RunSettings, run_at
    from quotas.config import parse_config_text

    k = o.time_scale
    cfg = parse_config_text(sc.fleet_yaml({w.model: w.spec(cap_ms - HTTP_MS)}, broker_name="screen"))
    rs = RunSettings(duration_s=60.0, warmup_s=5.0, drain_s=2.0, seed=0, batching="eager")
    out: dict[float, list[dict[str, Any]]] = {}
    for r in rates:
        scored = []
        for bt in GRID_BATCHES:
            for wt in GRID_WAITS_MS:
                m = run_at(cfg, f"static:{bt}:{wt * k:g}", r, rs).models[w.model]
                p95 = m.p95_ms if m.p95_ms is not None else float("inf")
                scored.append((-round(m.goodput_rps, 2), round(p95), bt, wt * k))
        scored.sort()
        picked, seen = [], set()
        for g, p95, bt, wt in scored:
            if (g, p95) in seen:
                continue
            seen.add((g, p95))
            picked.append({"arm": f"static:{bt}:{wt:g}", "batch": bt, "wait_ms": wt, "sim_goodput_rps": -g, "sim_p95_ms": p95})
            if len(picked) == top:
                break
        out[r] = picked
    return out


def oracle(o: Opts) -> dict[str, Any]:
    """Broker goodput / best static goodput at each rate of a sweep, at cap 1.2·S.

    The static grid is batch 8..128 x wait 0, 5, 10, 20, 30, 50 ms (x time scale; with eager
    batching a static arm's batch is 1 + rate x wait, so only long waits form big batches).
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
    o = Opts(**{**o.__dict__, "min_requests": 150 if not o.quick else 100, "max_window_s": 20.0 if not o.quick else 12.0})
    rates = [ref * m for m in mults]
    o.log(f"[oracle] reference {ref:.2f}/s, cap 1.2·S {cap:.0f} ms; screening the static grid in the simulator")
    cands = screen_grid(w, cap, rates, top, o)
    res: dict[str, Any] = {"scenario": "oracle", "machine": sc.machine_info(), "workload": w.label, "cap_ms": cap,
                           "reference_rps": ref, "reference": ref_doc, "time_scale": k,
                           "grid": [f"static:{b}:{wt * k:g}" for b in GRID_BATCHES for wt in GRID_WAITS_MS],
                           "screen": {f"{r:.3f}": c for r, c in cands.items()}, "rates": []}
    warm = {w.model: w.body}
    with sc.Stack() as stack:
        br = _fleet(stack, {w.model: w.spec(cap)}, "brk", warm)
        try:
            broker_rows: dict[float, list[sc.Measurement]] = {}
            for r in rates:
                broker_rows[r] = [_run(br, w.model, r, s, cap, o, w.body) for s in o.seeds]
                for m in broker_rows[r]:
                    _say_row(o, f"broker s{m.seed}")(m.row())
        finally:
            br.delete()
        arms: dict[tuple[int, float], list[float]] = {}
        for r in rates:
            for c in cands[r]:
                arms.setdefault((c["batch"], c["wait_ms"]), []).append(r)
        (b0, w0), _ = next(iter(arms.items()))
        st = _fleet(stack, {w.model: w.static_spec(cap, b0, w0)}, "grid", warm)
        static_rows: dict[float, dict[str, sc.Measurement]] = {r: {} for r in rates}
        try:
            for (b, wt), rs_ in arms.items():
                st.set_static({w.model: (b, wt)})
                for r in rs_:
                    m = _run(st, w.model, r, o.seeds[0], cap, o, w.body)
                    static_rows[r][f"static:{b}:{wt:g}"] = m
                    _say_row(o, f"static {b}/{wt:g}")(m.row())
        finally:
            st.delete()
    for r in rates:
        b0m = broker_rows[r][0]
        gb = b0m.goodput_rps
        statics = {arm: m.goodput_rps for arm, m in static_rows[r].items()}
        best_arm = max(statics, key=lambda a: (statics[a], -(static_rows[r][a].summary[w.model].p95_ms or 1e9)))
        atts = [m.summary[w.model].attainment for m in broker_rows[r]]
        res["rates"].append({
            "rate_rps": r, "broker_goodput_rps": gb, "broker_attainment": atts[0],
            "broker_attainment_seeds": atts, "broker_goodput_seeds": [m.goodput_rps for m in broker_rows[r]],
            "broker_p95_ms": b0m.summary[w.model].p95_ms,
            "broker_p95_seeds_ms": [m.summary[w.model].p95_ms for m in broker_rows[r]],
            "broker_mean_batch": b0m.batch[w.model]["mean_batch"],
            "broker_settings": b0m.extra.get("settings"),
            "broker_decisions": b0m.extra.get("decisions"),
            "static_goodput_rps": statics, "best_static": best_arm, "best_static_goodput_rps": statics[best_arm],
            "oracle_ratio": gb / statics[best_arm] if statics[best_arm] > 0 else None,
            "oracle_ratio_floor": min(atts),
            "static_p95_ms": {arm: m.summary[w.model].p95_ms for arm, m in static_rows[r].items()},
            "static_attainment": {arm: m.summary[w.model].attainment for arm, m in static_rows[r].items()},
        })
        o.log(f"[oracle] {r:6.1f}/s  broker {gb:6.1f}/s  best {best_arm} {statics[best_arm]:6.1f}/s  "
              f"ratio {res['rates'][-1]['oracle_ratio']}  broker attainment over seeds {min(atts):.3f}..{max(atts):.3f}")
    return res


# ------------------------------------------------------------------------------ burst
def burst(o: Opts) -> dict[str, Any]:
    """Three models on one card; one jumps to 5x for a while; broker vs a static equal split."""
    k = o.time_scale
    names = ["alpha", "beta", "gamma"]
    a_ms, c_ms = 15.0 * k * 2, 0.5 * k  # a=300 ms, c=5 ms at k=10: a large fixed cost (GPU-like)
    # Memory scaled down (host RSS stands in for VRAM; profiled zero-fills its per-batch scratch,
    # so 16 MiB items cost real CPU on 2 cores): 4 MiB per item, 16 MiB weights, 192 MiB card.
    item = 4 * sc.MiB
    weights = 16 * sc.MiB
    cap = 1200.0 * k / 10.0
    # Eager batching: static 8 with a 100 ms wait forms batches of 1 + rate x wait, so at 8/s it
    # was already past its saturation (batches of 1.8, utilisation 1.4). 2/s per model (x10/k)
    # is a base load static serves (batch 1.2, utilisation ~0.5) and its 5x burst is beyond it.
    base_rate = 2.0 * 10.0 / k
    if o.quick:
        pre, length, post = 12.0, 24.0, 10.0
    else:
        pre, length, post = 50.0, 60.0, 50.0
    duration = pre + length + post
    opts = {"a_ms": a_ms, "c_ms": c_ms, "weights_bytes": weights, "bytes_per_item": item, "unit": "requests"}

    def spec(static: bool) -> dict[str, Any]:
        rt, _ = _timeouts(cap)
        quota = {"min": "24MiB", "base": "64MiB", "max": "272MiB"} if not static else \
            {"min": "64MiB", "base": "64MiB", "max": "64MiB"}
        s = sc.profiled_spec(a_ms, c_ms, cap, quota=quota, floor=2, ceiling=64, window_s=6.0)
        s["options"] = dict(opts)
        s["request_timeout_s"] = rt
        s["wait"]["max_ms"] = 10.0 * k
        s["control"].update({"idle_hold_s": 2.0, "reclaim_hold_s": 1.0})
        if static:  # equal split: each model gets a third of the card and the batch that fits it
            s = sc.pin_static(s, 8, 10.0 * k)
        return s

    times = arr.burst([base_rate] * 3, busy=0, duration_s=duration, start_s=pre, length_s=length, factor=5.0, seed=0)
    body = lg.default_body("profiled")
    sched = lg.merge(*[lg.plan(n, t, body) for n, t in zip(names, times)])
    res: dict[str, Any] = {"scenario": "burst", "machine": sc.machine_info(), "models": names, "a_ms": a_ms, "c_ms": c_ms,
                           "cap_ms": cap, "base_rate_rps": base_rate, "burst": {"start_s": pre, "length_s": length, "factor": 5.0},
                           "capacity": "192MiB", "arms": {}}
    warm = {n: body for n in names}
    _, client_t = _timeouts(cap)
    with sc.Stack() as stack:
        for arm, static in (("broker", False), ("static-split", True)):
            tgt = _fleet(stack, {n: spec(static) for n in names}, arm, warm, capacity="192MiB")
            try:
                run = lg.run(tgt.base_url, sched, timeout_s=client_t, status_url=tgt.status_url, status_every_s=1.0)
                code, final = sc.http_json(tgt.status_url)
                decisions = sc.decisions_since(tgt, 0, None, kinds=())[0]
            finally:
                tgt.delete()
            lo, hi = 5.0, duration - 1.0
            summ = lg.summarize(run.records, duration, {n: cap for n in names}, warmup_s=lo, cooldown_s=1.0)
            in_burst = lg.summarize(run.records, pre + length, {n: cap for n in names}, warmup_s=pre)
            series = {n: lg.status_series(run.status_samples, n, ("max_batch_size", "grant_bytes", "used_bytes", "p95_ms", "queue_depth"))
                      for n in names}
            res["arms"][arm] = {
                "summary": {n: s.to_dict() for n, s in summ.items()},
                "in_burst": {n: s.to_dict() for n, s in in_burst.items()},
                "batch": {n: lg.batch_stats(run.records, n, lo_s=lo, hi_s=hi) for n in names},
                "ooms": {n: (final or {}).get("models", {}).get(n, {}).get("oom_splits") for n in names},
                "emergency_shrinks": {n: (final or {}).get("models", {}).get(n, {}).get("emergency_shrinks") for n in names},
                "peak_used_bytes": {n: max([u for u in series[n]["used_bytes"] if u is not None] or [0]) for n in names},
                "series": series,
                "decisions": decisions[-400:],
                "final_status": final,
                "status_gpu": [{"t_s": x.get("t_s"), "gpu": (x.get("status") or {}).get("gpu")} for x in run.status_samples],
            }
            o.log(f"[burst] {arm}: " + "  ".join(f"{n} att {summ[n].attainment:.3f} (burst {in_burst[n].attainment if n in in_burst else float('nan'):.3f})"
                                                for n in names if n in summ))
    return res


# ------------------------------------------------------------------------------ overhead
def overhead(o: Opts) -> dict[str, Any]:
    """Broker-managed deployment pinned static vs plain Ray Serve @serve.batch, same setting."""
    w = profiled_workload(o.time_scale)
    # batch 16 with a 30 ms (scaled) wait: under eager batching the batch fills to 16 near
    # saturation (1 + rate x wait >= 16), so both arms run the same full batches there
    batch, wait = 16, 30.0 * o.time_scale
    sat = sc.eager_saturation(batch, wait, w.a_ms, w.c_ms)
    cap = 3_000.0  # replica request timeout 15 s: a backlog cannot outlive the next run
    rates = {"half": 0.5 * sat, "saturated": 1.15 * sat}
    res: dict[str, Any] = {"scenario": "overhead", "machine": sc.machine_info(), "workload": w.label, "batch": batch,
                           "wait_ms": wait, "model_saturation_rps": sat, "rates": rates, "runs": []}
    with sc.Stack() as stack:
        fleet = stack.deploy_fleet(sc.fleet_yaml({w.model: w.static_spec(cap, batch, wait)},
                                                 broker_name=f"bench-ovh-{int(time.time()) % 10**6}", http_port=stack.port),
                                   app="fleet-pinned", route_prefix="/fleet", warm_models={w.model: w.body})
        plain = stack.deploy_plain(w.ref, w.options, batch, wait, w.model, app="plain", route_prefix="/plain",
                                   warm_body=w.body)
        try:
            for label, r in rates.items():
                for s in o.seeds:
                    for arm, tgt in (("pinned", fleet), ("plain", plain)):  # alternate: drift hits both
                        m = _run(tgt, w.model, r, s, cap, o, w.body, fixed=True)
                        sm = m.summary[w.model]
                        res["runs"].append({"load": label, "arm": arm, "seed": s, "rate": r, "completed_rps": sm.throughput_rps,
                                            "p50_ms": sm.p50_ms, "p95_ms": sm.p95_ms, "mean_batch": m.batch[w.model]["mean_batch"]})
                        o.log(f"  overhead {label:<9} {arm:<6} seed {s}: completed {sm.throughput_rps:.2f}/s  P50 {sm.p50_ms} P95 {sm.p95_ms}")
        finally:
            fleet.delete()
            plain.delete()
    for label in rates:
        pin = [x for x in res["runs"] if x["load"] == label and x["arm"] == "pinned"]
        pla = [x for x in res["runs"] if x["load"] == label and x["arm"] == "plain"]
        res[f"{label}_throughput_ratio"] = float(np.mean([x["completed_rps"] for x in pin]) / np.mean([x["completed_rps"] for x in pla]))
        res[f"{label}_p50_ratio"] = float(np.mean([x["p50_ms"] for x in pin]) / np.mean([x["p50_ms"] for x in pla]))
    res["overhead_ratio"] = res["saturated_throughput_ratio"]
    o.log(f"[overhead] throughput ratio pinned/plain {res['overhead_ratio']:.3f}")
    return res


# ------------------------------------------------------------------------------ trace
def trace(o: Opts) -> dict[str, Any]:
    """Azure LLM trace (code, 2023) arrivals and ContextTokens lengths at a few scales:
    token-priced ``profiled`` (cost per token), broker vs static 8 (8 × mean length tokens)."""
    k = o.time_scale
    gaps, tok = arr.load_trace()
    mean_tok = float(np.mean(tok))
    a_ms, c_tok = 20.0 * k, 0.5 * k / mean_tok  # a request of mean length costs c = 0.5 ms (x k)
    w = profiled_workload(k)
    ref_doc = measured_reference(o, w)  # static 8's measured S and reference (Poisson, mean-length requests)
    cap = 1.2 * ref_doc["S_ms"] * 2  # the trace is far burstier than Poisson (gap CV ~13): twice the Poisson cap
    opts = {"a_ms": a_ms, "c_ms": c_tok, "weights_bytes": 16 * sc.MiB, "bytes_per_item": 64, "unit": "tokens",
            "max_tokens": 100_000}
    ref = ref_doc["reference_rps"]  # half of static 8:10's measured (eager) saturation
    scales = (1.0, 4.0) if o.quick else (1.0, 4.0, 8.0)
    # bursty (gap CV ~13): 20 s measured windows (16 s in --quick), every seed a different stretch
    o = Opts(**{**o.__dict__, "duration_s": o.warmup_s + (16.0 if o.quick else 20.0) + o.cooldown_s})
    rt, client_t = _timeouts(cap)

    def spec(static: bool) -> dict[str, Any]:
        s = sc.profiled_spec(a_ms, c_tok, cap, window_s=10.0)
        s["options"] = dict(opts)
        s["batch"] = {"unit": "tokens", "floor": int(mean_tok), "ceiling": int(128 * mean_tok)}
        s["wait"]["max_ms"] = 20.0 * k
        s["request_timeout_s"] = rt
        s["max_body_bytes"] = "64KiB"
        return sc.pin_static(s, int(8 * mean_tok), 10.0 * k) if static else s

    bodyf = lambda t: lg.default_body("profiled", int(t))  # noqa: E731
    res: dict[str, Any] = {"scenario": "trace", "machine": sc.machine_info(), "a_ms": a_ms, "c_ms_per_token": c_tok,
                           "mean_tokens": mean_tok, "cap_ms": cap, "reference_rps": ref, "reference": ref_doc, "rows": []}
    with sc.Stack() as stack:
        for arm, static in (("broker", False), ("static8", True)):
            tgt = _fleet(stack, {"prof": spec(static)}, arm, {"prof": lg.default_body("profiled", int(mean_tok))})
            try:
                for scale in scales:
                    r = ref * scale
                    for s in o.seeds:
                        times, lens = arr.trace(None, r, o.duration_s, s)
                        m = _run(tgt, "prof", r, s, cap, o, b"", times=times, tokens=lens, bodyf=bodyf)
                        if "prof" not in m.summary:  # gap CV ~13: a short window can hold no arrival
                            o.log(f"  trace {arm} x{scale} seed {s}: no arrivals in the measured window")
                            continue
                        sm = m.summary["prof"]
                        res["rows"].append({"arm": arm, "scale": scale, "rate_rps": r, "seed": s, **sm.to_dict(),
                                            **m.batch["prof"], **m.extra})
                        o.log(f"  trace {arm:<8} x{scale:<4} {r:6.1f}/s seed {s}: att {sm.attainment:.3f}  goodput {sm.goodput_rps:.1f}"
                              f"  P95 {sm.p95_ms}  batch {m.batch['prof']['mean_batch']}")
            finally:
                tgt.delete()
    return res


# ------------------------------------------------------------------------------ oracle knee
def screen_knees(w: Workload, cap_ms: float, start_rps: float, top: int, o: Opts) -> list[dict[str, Any]]:
    """Every static grid arm's knee at ``cap_ms`` in the simulator (eager batching, the cap
    less the HTTP path): the ``top`` arms with the highest knees, the candidates ``oracle-knee``
    searches live. (Ranking by goodput at one overloaded rate would favour arms whose waits
    alone exceed the cap.)"""
    from bench.knee import RunSettings, knee
    from quotas.config import parse_config_text

    k = o.time_scale
    cfg = parse_config_text(sc.fleet_yaml({w.model: w.spec(cap_ms - HTTP_MS)}, broker_name="screen"))
    rs = RunSettings(duration_s=60.0, warmup_s=5.0, drain_s=2.0, seed=0, batching="eager")
    scored = []
    for bt in GRID_BATCHES:
        for wt in GRID_WAITS_MS:
            kn = knee(cfg, f"static:{bt}:{wt * k:g}", 0.5 * start_rps, rs, step=1.2, bisect_iters=3).knee_rps
            scored.append((-round(kn, 2), bt, wt * k))
    scored.sort()
    picked, seen = [], set()
    for kn, bt, wt in scored:  # one arm per distinct knee: bigger caps the wait never fills tie
        if kn in seen:
            continue
        seen.add(kn)
        picked.append({"arm": f"static:{bt}:{wt:g}", "batch": bt, "wait_ms": wt, "sim_knee_rps": -kn})
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
        broker_knee = next((r["broker"]["knee_rps"] for r in seed_doc.get("results", []) if r.get("workload") == w.label), None)
    except (OSError, ValueError, KeyError):
        broker_knee = None
    if broker_knee:
        start = broker_knee
    top = 2 if o.quick else 3
    cands = screen_knees(w, cap, start, top, o)
    o.log(f"[oracle-knee] cap 1.2·S {cap:.0f} ms; the simulator's highest static knees: "
          + ", ".join(f"{c['arm']} ({c['sim_knee_rps']:.1f}/s)" for c in cands))
    res: dict[str, Any] = {"scenario": "oracle-knee", "machine": sc.machine_info(), "workload": w.label, "cap_ms": cap,
                           "reference": ref_doc, "time_scale": o.time_scale, "broker_knee_rps": broker_knee,
                           "screen_rate_rps": start, "screen": cands, "arms": []}
    warm = {w.model: w.body}
    with sc.Stack() as stack:
        st = _fleet(stack, {w.model: w.static_spec(cap, cands[0]["batch"], cands[0]["wait_ms"])}, "oknee", warm)
        try:
            for c in cands:
                b, wt = c["batch"], c["wait_ms"]
                st.set_static({w.model: (b, wt)})
                kn, rows = sc.live_knee(lambda r: _run(st, w.model, r, 0, cap, o, w.body), start, step=1.1,
                                        bisect_iters=1, max_runs=3 if o.quick else 5,
                                        on_row=_say_row(o, f"static {b}/{wt:g}"))
                res["arms"].append({"arm": c["arm"], "knee_rps": kn, "rows": rows})
                o.log(f"[oracle-knee] {c['arm']} knee at 1.2·S: {kn:.1f}/s")
        finally:
            st.delete()
    best = max(res["arms"], key=lambda a: a["knee_rps"])
    res["oracle_knee_rps"], res["oracle_arm"] = best["knee_rps"], best["arm"]
    res["broker_vs_oracle"] = broker_knee / best["knee_rps"] if broker_knee and best["knee_rps"] else None
    return res


SCENARIOS: dict[str, Callable[[Opts], dict[str, Any]]] = {
    "seed": seed, "oracle": oracle, "burst": burst, "overhead": overhead, "trace": trace, "oracle-knee": oracle_knee,
}
