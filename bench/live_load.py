"""``python -m bench burst``, ``overhead`` and ``trace``: a burst on a shared card, the wrapper's
overhead against plain Serve, and the Azure code trace."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bench import loadgen as lg
from bench import scenarios as sc
from bench.live_runs import Opts, fleet_target, measured_reference, profiled_workload, run_arm, timeouts
from gpubroker.sim import arrivals as arr


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
        rt, _ = timeouts(cap, o.rules)
        quota = (
            {"min": "24MiB", "base": "64MiB", "max": "272MiB"}
            if not static
            else {"min": "64MiB", "base": "64MiB", "max": "64MiB"}
        )
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
    res: dict[str, Any] = {
        "scenario": "burst",
        "rules": o.rules.to_dict(),
        "search": o.search.to_dict(),
        "machine": sc.machine_info(),
        "models": names,
        "a_ms": a_ms,
        "c_ms": c_ms,
        "cap_ms": cap,
        "base_rate_rps": base_rate,
        "burst": {"start_s": pre, "length_s": length, "factor": 5.0},
        "capacity": "192MiB",
        "quota_base_bytes": 64 * sc.MiB,  # each model's base under the broker, the static split's share
        "arms": {},
    }
    warm = {n: body for n in names}
    _, client_t = timeouts(cap, o.rules)
    with sc.Stack(direct_ingress=o.direct) as stack:
        for arm, static in (("broker", False), ("static-split", True)):
            tgt = fleet_target(stack, {n: spec(static) for n in names}, arm, warm, capacity="192MiB")
            try:
                run = lg.run(tgt.base_url, sched, timeout_s=client_t, status_url=tgt.status_url, status_every_s=1.0)
                code, final = sc.http_json(tgt.status_url)
                decisions = sc.decisions_since(tgt, 0, None, kinds=())[0]
            finally:
                tgt.delete()
            lo, hi = 5.0, duration - 1.0
            summ = lg.summarize(run.records, duration, {n: cap for n in names}, warmup_s=lo, cooldown_s=1.0)
            in_burst = lg.summarize(run.records, pre + length, {n: cap for n in names}, warmup_s=pre)
            series = {
                n: lg.status_series(
                    run.status_samples, n, ("max_batch_size", "grant_bytes", "used_bytes", "p95_ms", "queue_depth")
                )
                for n in names
            }
            res["arms"][arm] = {
                "summary": {n: s.to_dict() for n, s in summ.items()},
                "in_burst": {n: s.to_dict() for n, s in in_burst.items()},
                "batch": {n: lg.batch_stats(run.records, n, lo_s=lo, hi_s=hi) for n in names},
                "ooms": {n: (final or {}).get("models", {}).get(n, {}).get("oom_splits") for n in names},
                "emergency_shrinks": {
                    n: (final or {}).get("models", {}).get(n, {}).get("emergency_shrinks") for n in names
                },
                "peak_used_bytes": {
                    n: max([u for u in series[n]["used_bytes"] if u is not None] or [0]) for n in names
                },
                "series": series,
                "decisions": decisions[-400:],
                "final_status": final,
                "status_gpu": [
                    {"t_s": x.get("t_s"), "gpu": (x.get("status") or {}).get("gpu")} for x in run.status_samples
                ],
            }
            o.log(
                f"[burst] {arm}: "
                + "  ".join(
                    f"{n} att {summ[n].attainment:.3f} (burst {in_burst[n].attainment if n in in_burst else float('nan'):.3f})"
                    for n in names
                    if n in summ
                )
            )
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
    res: dict[str, Any] = {
        "scenario": "overhead",
        "rules": o.rules.to_dict(),
        "search": o.search.to_dict(),
        "machine": sc.machine_info(),
        "workload": w.label,
        "batch": batch,
        "wait_ms": wait,
        "model_saturation_rps": sat,
        "rates": rates,
        "runs": [],
    }
    with sc.Stack(direct_ingress=o.direct) as stack:
        fleet = stack.deploy_fleet(
            sc.fleet_yaml(
                {w.model: w.static_spec(cap, batch, wait)},
                broker_name=f"bench-ovh-{int(time.time()) % 10**6}",
                http_port=stack.port,
            ),
            app="fleet-pinned",
            route_prefix="/fleet",
            warm_models={w.model: w.body},
        )
        plain = stack.deploy_plain(
            w.ref, w.options, batch, wait, w.model, app="plain", route_prefix="/plain", warm_body=w.body
        )
        try:
            for label, r in rates.items():
                for s in o.seeds:
                    for arm, tgt in (("pinned", fleet), ("plain", plain)):  # alternate: drift hits both
                        m = run_arm(tgt, w.model, r, s, cap, o, w.body, fixed=True)
                        sm = m.summary[w.model]
                        res["runs"].append(
                            {
                                "load": label,
                                "arm": arm,
                                "seed": s,
                                "rate": r,
                                "completed_rps": sm.throughput_rps,
                                "p50_ms": sm.p50_ms,
                                "p95_ms": sm.p95_ms,
                                "mean_batch": m.batch[w.model]["mean_batch"],
                            }
                        )
                        o.log(
                            f"  overhead {label:<9} {arm:<6} seed {s}: completed {sm.throughput_rps:.2f}/s  P50 {sm.p50_ms} P95 {sm.p95_ms}"
                        )
        finally:
            fleet.delete()
            plain.delete()
    for label in rates:
        pin = [x for x in res["runs"] if x["load"] == label and x["arm"] == "pinned"]
        pla = [x for x in res["runs"] if x["load"] == label and x["arm"] == "plain"]
        res[f"{label}_throughput_ratio"] = float(
            np.mean([x["completed_rps"] for x in pin]) / np.mean([x["completed_rps"] for x in pla])
        )
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
    opts = {
        "a_ms": a_ms,
        "c_ms": c_tok,
        "weights_bytes": 16 * sc.MiB,
        "bytes_per_item": 64,
        "unit": "tokens",
        "max_tokens": 100_000,
    }
    ref = ref_doc["reference_rps"]  # half of static 8:10's measured (eager) saturation
    scales = (1.0, 4.0) if o.quick else (1.0, 4.0, 8.0)
    # bursty (gap CV ~13): 20 s measured windows (16 s in --quick), every seed a different stretch
    o = Opts(**{**o.__dict__, "duration_s": o.warmup_s + (16.0 if o.quick else 20.0) + o.cooldown_s})
    rt, client_t = timeouts(cap, o.rules)

    def spec(static: bool) -> dict[str, Any]:
        s = sc.profiled_spec(a_ms, c_tok, cap, window_s=10.0)
        s["options"] = dict(opts)
        s["batch"] = {"unit": "tokens", "floor": int(mean_tok), "ceiling": int(128 * mean_tok)}
        s["wait"]["max_ms"] = 20.0 * k
        s["request_timeout_s"] = rt
        s["max_body_bytes"] = "64KiB"
        return sc.pin_static(s, int(8 * mean_tok), 10.0 * k) if static else s

    bodyf = lambda t: lg.default_body("profiled", int(t))  # noqa: E731
    res: dict[str, Any] = {
        "scenario": "trace",
        "rules": o.rules.to_dict(),
        "search": o.search.to_dict(),
        "machine": sc.machine_info(),
        "a_ms": a_ms,
        "c_ms_per_token": c_tok,
        "mean_tokens": mean_tok,
        "cap_ms": cap,
        "reference_rps": ref,
        "reference": ref_doc,
        "rows": [],
    }
    with sc.Stack(direct_ingress=o.direct) as stack:
        for arm, static in (("broker", False), ("static8", True)):
            tgt = fleet_target(stack, {"prof": spec(static)}, arm, {"prof": lg.default_body("profiled", int(mean_tok))})
            try:
                for scale in scales:
                    r = ref * scale
                    for s in o.seeds:
                        times, lens = arr.trace(None, r, o.duration_s, s)
                        m = run_arm(tgt, "prof", r, s, cap, o, b"", times=times, tokens=lens, bodyf=bodyf)
                        if "prof" not in m.summary:  # gap CV ~13: a short window can hold no arrival
                            o.log(f"  trace {arm} x{scale} seed {s}: no arrivals in the measured window")
                            continue
                        sm = m.summary["prof"]
                        res["rows"].append(
                            {
                                "arm": arm,
                                "scale": scale,
                                "rate_rps": r,
                                "seed": s,
                                **sm.to_dict(),
                                **m.batch["prof"],
                                **m.extra,
                            }
                        )
                        o.log(
                            f"  trace {arm:<8} x{scale:<4} {r:6.1f}/s seed {s}: att {sm.attainment:.3f}  goodput {sm.goodput_rps:.1f}"
                            f"  P95 {sm.p95_ms}  batch {m.batch['prof']['mean_batch']}"
                        )
            finally:
                tgt.delete()
    return res
