"""Why the broker falls short of the static split on some model-seeds of bench lending's independent load.

It takes the per-model differences apart, in requests, for the arms without late shedding (the
benchmark's broker arms shed; this studies what is left without it): ``per_request`` (one seed,
the static split against ``broker-fixed``: the requests that meet the SLO under one arm only, how
long they waited and which batches ran in between) and ``variants`` (``broker-fixed`` with one
thing changed at a time, on several seeds). ``OldestWindowSim`` is an experiment, not the
replica: the live gate and Ray's batcher open a fresh wait window when a batch's first request
is pulled, as the simulator emulates. ``python -m bench.lending_gap --seeds 0,1,2 [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import lending as L
from gpubroker.quotas.config import FleetConfig
from gpubroker.sim.engine import SimOptions, Simulator, parse_arm
from gpubroker.sim.types import DONE, EV_TIMER, SimReplica

DURATION_S = 600.0  # bench lending's full independent load
WARMUP_S = 10.0


def fixed_wait(cfg: FleetConfig, wait_ms: float) -> FleetConfig:
    """The same fleet with every model's wait timeout pinned (min_ms = max_ms = ``wait_ms``)."""
    models = {
        n: s.model_copy(update={"wait": s.wait.model_copy(update={"min_ms": wait_ms, "max_ms": wait_ms})})
        for n, s in cfg.models.items()
    }
    return cfg.model_copy(update={"models": models})


class OldestWindowSim(Simulator):
    """The gate variant: a batch released from the gate after a busy batch closes once its oldest
    request has waited the wait timeout (or at once, when it already has), as the static arm's
    lazy batcher does, instead of waiting a fresh window from its release."""

    def _released(self, rep: SimReplica) -> None:
        if rep.forming is None:
            return
        deadline = max(self.now, self.arr_t[rep.forming[0]] + rep.wait_s)
        if deadline >= rep.timer_at:
            return
        rep.gate.form_until = deadline
        if deadline <= self.now + 1e-12:
            self._close_forming(rep)
            return
        rep.timer_at = deadline
        rep.timer_ver += 1
        self._push(deadline, EV_TIMER, rep, rep.timer_ver)


def batch_of(starts: np.ndarray, done_t: np.ndarray) -> np.ndarray:
    """Index (into the sorted ``starts``) of the batch each request ran in: with one replica and
    one batch at a time, the last batch of its model that started before the request was done."""
    return np.searchsorted(starts, done_t - 1e-9) - 1


def _sim(cfg: FleetConfig, arm: str, times: list[np.ndarray], duration_s: float) -> Simulator:
    sim = Simulator(
        cfg,
        parse_arm(arm),
        L.workload(cfg, times),
        duration_s,
        opts=SimOptions(warmup_s=WARMUP_S, drain_s=10.0, batching="lazy"),
    )
    sim.run()
    return sim


def _group_stats(sim: Simulator, m: int, ids: np.ndarray) -> dict[str, float]:
    own = np.array(sorted(t for (mm, t, *_r) in sim.batch_log if mm == m))
    other = np.array(sorted(t for (mm, t, *_r) in sim.batch_log if mm != m))
    arr, done = sim.t_np[ids], sim.done_t[ids]
    start = own[batch_of(own, done)]
    return {
        "to_batch_start_ms": float(np.mean(start - arr) * 1000.0),
        "own_batches_ahead": float(np.mean(np.searchsorted(own, start - 1e-9) - np.searchsorted(own, arr - 1e-9))),
        "other_batches_meanwhile": float(np.mean(np.searchsorted(other, done) - np.searchsorted(other, arr))),
        "latency_ms": float(np.mean(done - arr) * 1000.0),
    }


def per_request(seed: int, duration_s: float = DURATION_S) -> dict[str, Any]:
    """Static split against broker-fixed on one seed of the independent load, per request."""
    times = L.independent(L.IND_MEAN_RPS, duration_s, seed)
    cfg = L.fleet(fixed=True)
    arms = {
        "static-split": _sim(cfg, f"static:{L.STATIC_CAP}:10", times, duration_s),
        "broker-fixed": _sim(cfg, "broker", times, duration_s),
    }
    s, b = arms["static-split"], arms["broker-fixed"]
    sel = (s.t_np >= WARMUP_S) & (s.t_np < duration_s)
    slo_ms = np.array([cfg.models[n].slo_p95_ms for n in L.MODELS])[s.m_np]
    good = {k: sel & (v.status == DONE) & ((v.done_t - v.t_np) * 1000.0 <= slo_ms) for k, v in arms.items()}
    out: dict[str, Any] = {}
    for m, name in enumerate(L.MODELS):
        mine = s.m_np == m
        groups = {
            "good_only_static": np.where(mine & good["static-split"] & ~good["broker-fixed"])[0],
            "good_only_broker_fixed": np.where(mine & good["broker-fixed"] & ~good["static-split"])[0],
        }
        row: dict[str, Any] = {
            "offered": int((sel & mine).sum()),
            "misses": {k: int((sel & mine & ~g).sum()) for k, g in good.items()},
            "caps_run": {k: sorted({int(c) for c in v.series[name]["max_batch"]}) for k, v in arms.items()},
            "broker_wait_ms": [round(min(b.series[name]["wait_ms"]), 1), round(max(b.series[name]["wait_ms"]), 1)],
        }
        for g, ids in groups.items():
            row[g] = {"n": len(ids), **{k: _group_stats(v, m, ids) for k, v in arms.items()}} if len(ids) else {"n": 0}
        out[name] = row
    return out


Variant = tuple[str, Callable[[], FleetConfig], type[Simulator]]
VARIANTS: tuple[Variant, ...] = (
    ("broker-fixed", lambda: L.fleet(fixed=True), Simulator),
    ("broker", lambda: L.fleet(), Simulator),
    ("broker-fixed, wait 10 ms", lambda: fixed_wait(L.fleet(fixed=True), 10.0), Simulator),
    ("broker-fixed, wait 20 ms", lambda: fixed_wait(L.fleet(fixed=True), 20.0), Simulator),
    ("broker-fixed, wait 30 ms", lambda: fixed_wait(L.fleet(fixed=True), 30.0), Simulator),
    ("broker-fixed, window from oldest", lambda: L.fleet(fixed=True), OldestWindowSim),
    ("broker-fixed, wait 10 ms + window from oldest", lambda: fixed_wait(L.fleet(fixed=True), 10.0), OldestWindowSim),
)


def variants(seeds: tuple[int, ...], duration_s: float = DURATION_S) -> dict[str, Any]:
    """Per variant and seed, per model: requests within the SLO minus the static split's."""
    rows: dict[str, dict[str, list[int]]] = {v[0]: {} for v in VARIANTS}
    for seed in seeds:
        times = L.independent(L.IND_MEAN_RPS, duration_s, seed)
        static = L.run_arm(L.fleet(fixed=True), f"static:{L.STATIC_CAP}:10", times, duration_s, WARMUP_S)
        for name, cfg, cls in VARIANTS:
            r = L.run_arm(cfg(), "broker", times, duration_s, WARMUP_S, sim_cls=cls)
            rows[name][str(seed)] = [
                round((r["models"][m]["attainment"] - static["models"][m]["attainment"]) * r["models"][m]["offered"])
                for m in L.MODELS
            ]
    summary = {}
    for name, per_seed in rows.items():
        d = [x for v in per_seed.values() for x in v]
        summary[name] = {
            "short_model_seeds": sum(x < 0 for x in d),
            "model_seeds": len(d),
            "mean_requests": float(np.mean(d)),
            "sd_requests": float(np.std(d)) if len(d) > 1 else math.nan,
        }
    return {"seeds": list(seeds), "diff_requests": rows, "summary": summary}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="independent-load seeds for the variants, comma-separated")
    ap.add_argument("--seed", type=int, default=1, help="the seed the per-request comparison looks at")
    ap.add_argument("--out", type=Path, default=None, help="write lending_gap.json here")
    a = ap.parse_args(argv)
    res = {
        "per_request": {"seed": a.seed, "models": per_request(a.seed)},
        "variants": variants(tuple(int(x) for x in a.seeds.split(","))),
    }
    for name, row in res["per_request"]["models"].items():
        print(
            f"seed {a.seed} {name}: offered {row['offered']}, misses {row['misses']}, caps {row['caps_run']}, broker wait {row['broker_wait_ms']} ms"
        )
        for g in ("good_only_static", "good_only_broker_fixed"):
            x = row[g]
            if x["n"]:
                print(
                    f"  {g} {x['n']}: "
                    + "; ".join(
                        f"{k}: {v['latency_ms']:.1f} ms, batch starts after {v['to_batch_start_ms']:.1f} ms, "
                        f"{v['own_batches_ahead']:.2f} own / {v['other_batches_meanwhile']:.1f} other batches"
                        for k, v in x.items()
                        if k != "n"
                    )
                )
    print("\n| variant | " + " | ".join(f"seed {s}" for s in res["variants"]["seeds"]) + " | short | mean | sd |")
    print("|---|" + "---|" * (len(res["variants"]["seeds"]) + 3))
    for name, per_seed in res["variants"]["diff_requests"].items():
        sm = res["variants"]["summary"][name]
        print(
            f"| {name} | "
            + " | ".join(" ".join(f"{x:+d}" for x in v) for v in per_seed.values())
            + f" | {sm['short_model_seeds']}/{sm['model_seeds']} | {sm['mean_requests']:+.1f} | {sm['sd_requests']:.1f} |"
        )
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "lending_gap.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
    return res


if __name__ == "__main__":
    main()
