"""What every live scenario shares: options, one measured run, the workloads, fleets and the peer.

The scenarios themselves are in ``bench.live_seed``, ``bench.live_oracle`` and
``bench.live_load``; ``bench.scenarios_live`` names them. See there for the time scale.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench import loadgen as lg
from bench import scenarios as sc
from bench.tagged import TAGGED
from gpubroker.sim import arrivals as arr
from gpubroker.sim.knee import ArmRules, Search

DEFAULT_RULES = ArmRules()  # every arm of a comparison runs under one rule (BENCHMARK.md)


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
    # The window offers exactly its rate (``knee_arrivals``); exact_window False: a plain draw
    # (how knee runs were drawn before 2026-12-02, kept for the side-by-side comparison).
    min_requests: int = 180
    min_window_s: float = 8.0
    max_window_s: float = 20.0
    exact_window: bool = True
    peer: bool = True
    arrivals: str = "poisson"  # knee and sweep runs: poisson, or gamma:CV (bursty, BENCHMARK.md's CV 2 and 4)
    seed_json: str | None = None  # a `bench seed` result: oracle and trace take its measured S and reference
    # Serve's direct ingress (gpubroker.deployments.serve.direct_ingress): a one-model fleet's load goes to its
    # replica's own port instead of the proxy; fleets of several models still load through the proxy
    direct: bool = False
    # every arm of a comparison: one deadline and shedding rule, one knee search (BENCHMARK.md)
    rules: ArmRules = field(default_factory=ArmRules)
    search: Search = field(default_factory=lambda: Search(step=1.15, bisect_iters=2, max_runs=6))
    log: Callable[[str], None] = print
    out: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, quick: bool, **kw: Any) -> Opts:
        if quick:
            return cls(
                quick=True,
                seeds=(0,),
                duration_s=12.0,
                warmup_s=4.0,
                static_warmup_s=1.5,
                cooldown_s=0.5,
                min_requests=100,
                min_window_s=5.0,
                max_window_s=16.0,
                search=Search(step=1.15, bisect_iters=1, max_runs=4),
                **kw,
            )
        return cls(quick=False, **kw)


def timeouts(cap_ms: float, rules: ArmRules = DEFAULT_RULES) -> tuple[float, float]:
    """(replica request_timeout_s, client timeout_s) under ``rules``, the same for every arm: the
    replica ends a request at the deadline (a miss anyway); the client waits 1 s more for its 504."""
    rt = rules.deadline_s(cap_ms)
    return rt, rt + 1.0


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
    schedule, so the measured windows of both hold the same requests.

    The measured window holds exactly rate x window arrivals (``arrivals.exact_count``, spaced
    as ``o.arrivals`` spaces them); warm-up and cool-down are plain draws. A knee is "the
    largest rate that passes", and the held knee compares seeds at one rate: with a plain draw
    one seed's 8-s window offered 1.08-1.10x the nominal rate at every rate of the profiled
    knee (seed 2, 57.6-67.2/s) and MiniLM's 0.85-1.16x, so the seeds differed by how much load
    they offered, not only by how it was spaced."""
    warm, duration = run_length(o, rate, adaptive)
    shift = o.warmup_s - warm
    window = duration - warm - o.cooldown_s
    lo, hi = o.warmup_s, o.warmup_s + window  # the measured window, in the adaptive arm's time
    plain = draw_arrivals(o.arrivals, rate, duration + shift, seed)
    if not o.exact_window:
        return plain[plain >= shift] - shift, warm, duration
    inner = lo + arr.exact_count(rate, window, seed, parse_arrivals(o.arrivals))
    times = np.concatenate([plain[plain < lo], inner, plain[plain >= hi]])
    return times[times >= shift] - shift, warm, duration


def run_arm(
    target: Any,
    model: str,
    rate: float,
    seed: int,
    cap_ms: float,
    o: Opts,
    body: bytes,
    times: np.ndarray | None = None,
    tokens: np.ndarray | None = None,
    bodyf: Callable[[int], bytes] | None = None,
    fixed: bool = False,
) -> sc.Measurement:
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
    _, client_t = timeouts(cap_ms, o.rules)
    seq0 = sc.decisions_since(target, 0, model)[1] if dynamic else 0
    m = sc.measure(
        target,
        sched,
        duration,
        {model: cap_ms},
        warmup_s=warm,
        cooldown_s=o.cooldown_s,
        rate=rate,
        seed=seed,
        poll=fleet,
        timeout_s=client_t,
    )
    m.extra["window_s"] = round(duration - warm - o.cooldown_s, 2)
    if fleet:  # what the replicas were told during the measured window (status polls)
        m.extra["settings"] = lg.settings_seen(m.status_samples, model, warm, duration - o.cooldown_s)
    if dynamic:  # the broker's own log of what it set and why (GET /v1/decisions)
        m.extra["decisions"] = sc.decisions_since(target, seq0, model)[0][-40:]
    return m


def say_row(o: Opts, label: str) -> Callable[[dict[str, Any]], None]:
    def f(row: dict[str, Any]) -> None:
        m = next(iter(row["models"].values()))
        st = row.get("settings") or {}
        cap = (st.get("max_batch_size") or {}).get("median")
        wait = (st.get("batch_wait_timeout_s") or {}).get("median")
        told = f"  set cap {cap:g} wait {wait * 1000:.0f} ms" if cap is not None and wait is not None else ""
        o.log(
            f"  {label:<14} rate {row['rate']:7.2f}/s  {'PASS' if row['pass'] else 'fail'}  P95 {m['p95_ms']} ms "
            f"(cap {m['cap_ms']})  att {m['attainment']:.3f}  batch {None if m['mean_batch'] is None else round(m['mean_batch'], 1)}"
            f"  lag99 {m['send_lag_p99_ms']}{told}  decisions {len(row.get('decisions') or [])}"
        )

    return f


def pooled_fit(rows: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """Pool the per-run fits (weighted by batches seen) into one a, c."""
    pts = [
        (r["models"][model]["fit_a_ms"], r["models"][model]["fit_c_ms"], r["models"][model]["fit_batches"])
        for r in rows
        if model in r["models"] and r["models"][model].get("fit_a_ms") is not None
    ]
    if not pts:
        return {"a_ms": None, "c_ms": None}
    w = np.array([p[2] for p in pts], dtype=float)
    return {
        "a_ms": float(np.average([p[0] for p in pts], weights=w)),
        "c_ms": float(np.average([p[1] for p in pts], weights=w)),
        "batches": int(w.sum()),
    }


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

    def spec(self, cap_ms: float, rules: ArmRules = DEFAULT_RULES) -> dict[str, Any]:
        rt, _ = timeouts(cap_ms, rules)
        if self.kind == "minilm":
            s = sc.minilm_spec(cap_ms, ceiling=128 * self.tokens, floor=self.tokens)
        else:
            s = sc.profiled_spec(self.options["a_ms"], self.options["c_ms"], cap_ms)
            s["options"] = dict(self.options)
        s["request_timeout_s"] = rt
        s["shed_late"] = rules.shed
        s["wait"]["max_ms"] = max(50.0, 5 * self.static_wait_ms)
        return s

    def static_spec(self, cap_ms: float, batch: int, wait_ms: float, rules: ArmRules = DEFAULT_RULES) -> dict[str, Any]:
        if rules.shed:
            raise ValueError(
                "ArmRules.shed is True, but a static arm (control.strategy: static) cannot shed at the cap; "
                "use shed=False for every arm"
            )
        b = batch * self.tokens if self.kind == "minilm" else batch  # token models: B × request length
        return sc.pin_static(self.spec(cap_ms, rules), b, wait_ms)


def profiled_workload(k: float, a_ms: float = 20.0, c_ms: float = 0.5) -> Workload:
    return Workload(
        f"profiled a={a_ms:g} c={c_ms:g} (x{k:g} slow: a={a_ms * k:g} c={c_ms * k:g}; EMULATION)",
        "prof",
        "profiled",
        {
            "a_ms": a_ms * k,
            "c_ms": c_ms * k,
            "weights_bytes": 16 * sc.MiB,
            "bytes_per_item": 256 * 1024,
            "unit": "requests",
        },
        a_ms * k,
        c_ms * k,
        static_wait_ms=10.0 * k,
    )


def minilm_workload(tokens: int = 64) -> Workload:
    return Workload(
        f"minilm ({tokens} tokens/request, real CPU compute, 1 thread)",
        "minilm",
        "minilm",
        {"threads": 1, "max_tokens": 256},
        None,
        None,
        tokens=tokens,
        static_wait_ms=10.0,
        emulated=False,
    )


def fleet_target(
    stack: sc.Stack,
    specs: dict[str, dict[str, Any]],
    tag: str,
    warm: dict[str, bytes],
    capacity: str = "8GiB",
    model_cls: type | None = None,
) -> sc.FleetTarget:
    """One fleet app (its own broker) on ``stack``; ``model_cls`` replaces the model deployment's
    class (``bench.gated_static.GatedStaticModel`` for a gated static arm)."""
    text = sc.fleet_yaml(
        specs, broker_name=f"bench-{tag}-{int(time.time() * 1000) % 10**8}", http_port=stack.port, capacity=capacity
    )
    return stack.deploy_fleet(text, app=f"fleet-{tag}", warm_models=warm, model_cls=model_cls)


def peer_max_latency_ms(cap_ms: float, rules: ArmRules) -> float:
    """BentoML refuses a request it predicts later than ``max_latency_ms``: at the cap when every
    arm sheds, else at the deadline every arm has (where a request is a miss anyway)."""
    return cap_ms if rules.shed else 1000.0 * rules.deadline_s(cap_ms)


def start_peer(stack: sc.Stack, w: Workload, cap_ms: float, max_batch: int, o: Opts) -> Any:
    from bench.peer.runner import PeerServer, ensure_venv

    ensure_venv(o.log)
    p = PeerServer(
        w.ref,
        w.options,
        w.model,
        max_batch,
        peer_max_latency_ms(cap_ms, o.rules),
        sc.free_port(),
        log_path="/tmp/gpubroker-bench-peer.log",
    )
    p.wait_ready(json.loads(w.body))
    return p


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
                return {
                    "source": f"measured by `bench seed` ({doc.get('machine', {}).get('date')})",
                    "static8_saturation_rps": r["static8_saturation_rps"],
                    "reference_rps": r["reference_rps"],
                    "S_ms": r["S_ms"],
                }
    sat = sc.eager_saturation(8, w.static_wait_ms, w.a_ms, w.c_ms)
    return {
        "source": "eager-batching model (no seed result at this time scale)",
        "static8_saturation_rps": sat,
        "reference_rps": 0.5 * sat,
        "S_ms": SIM_S_MS * o.time_scale,
    }
