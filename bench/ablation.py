"""Which part buys what, in the simulator: batch formation (Ray's eager ``@serve.batch`` vs the
replica's lazy gate in front of it) crossed with control (a static setting vs the broker).

For a one-model profile config (``configs/sim-a20-c0.5.yaml``, ``configs/sim-a10-c2.yaml``),
at the broker's cap 1.2·S (S: static 8's P95 at the reference rate, eager formation, as
``gpubroker.sim.knee.seed_validation``), four arms:

- ``static, Ray's formation``: the best static arm of a grid (batch × wait), eager batching;
- ``static, lazy gate``: the best static arm of the same grid with the gate (``static:B:W:gate``);
- ``broker, Ray's formation``: the broker with ``broker.batch_formation: eager``;
- ``broker, lazy gate``: the broker as it ships (``batch_formation: lazy``).

Each knee is reported twice: seed 0's, and the knee that holds on every seed (``--seeds``;
``gpubroker.sim.knee.held_search``). A static arm's grid is searched on seed 0; its winner is then held
on every seed. Static 8 (eager, wait 10 ms) at the same cap is the reference row. Every arm runs
under the default ``ArmRules`` (no shedding, a late answer a miss). Run::

    .venv/bin/python -m bench.ablation configs/sim-a20-c0.5.yaml --out bench/out/ablation-a20.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from gpubroker.quotas.config import FleetConfig, load_config
from gpubroker.sim.knee import (
    RunSettings,
    Search,
    bound,
    cap_s,
    knee,
    knee_on_seeds,
    passes_at,
    reference_for,
    with_cap,
)
from gpubroker.sim.profile import profile_for

GRID_BATCHES = (8, 16, 24, 32, 48, 64, 96, 128)
GRID_WAITS_MS = (0.0, 5.0, 10.0, 20.0, 30.0, 50.0)


def with_formation(config: FleetConfig, formation: str) -> FleetConfig:
    kind = type(config.broker.batch_formation)  # the config's vocabulary (a StrEnum or a str)
    return config.model_copy(update={"broker": config.broker.model_copy(update={"batch_formation": kind(formation)})})


def best_static(config: FleetConfig, start_rate: float, rs: RunSettings, gated: bool) -> tuple[str, float, list]:
    """The grid's best static arm on seed 0: (label, knee, per-arm knees)."""
    best, best_arm, rows = 0.0, "", []
    for b in GRID_BATCHES:
        for w in GRID_WAITS_MS:
            arm = f"static:{b}:{w:g}" + (":gate" if gated else "")
            if best > 0 and not passes_at(config, arm, best, rs):  # cannot beat the best (as knee.oracle)
                rows.append({"arm": arm, "knee_rps": None, "skipped": f"fails at {best:.1f}/s"})
                continue
            k = knee(config, arm, best if best > 0 else start_rate, rs, search=Search(bisect_iters=4)).knee_rps
            rows.append({"arm": arm, "knee_rps": round(k, 2)})
            if k > best:
                best, best_arm = k, arm
    return best_arm, best, rows


def ablation(config: FleetConfig, rs: RunSettings, seeds: tuple[int, ...], say=print) -> dict[str, Any]:
    if len(config.models) != 1:
        raise ValueError(f"the ablation takes a one-model profile config; this one has {len(config.models)} models")
    name = next(iter(config.models))
    prof = profile_for(name, config.models[name])
    eager = with_formation(config, "eager")
    sat8, ref = reference_for(eager, name, rs)
    s_ms = cap_s(eager, name, rs, ref)
    cap = 1.2 * s_ms
    cfg_cap = with_cap(config, {name: cap})
    out: dict[str, Any] = {
        "model": name,
        "a_ms": prof.a_ms,
        "c_ms": prof.c_ms,
        "reference_rps": ref,
        "S_ms": s_ms,
        "cap_ms": cap,
        "bound_rps": bound(prof.a_ms, prof.c_ms, cap),
        "seeds": list(seeds),
        "settings": rs.__dict__,
        "arms": {},
    }
    say(
        f"{name}: a={prof.a_ms:g} c={prof.c_ms:g}; static 8 saturates at {sat8:.1f}/s, reference {ref:.1f}/s, "
        f"S = {s_ms:.1f} ms, cap 1.2·S = {cap:.1f} ms, bound {out['bound_rps']:.1f}/s"
    )
    t0 = time.time()
    k8 = knee_on_seeds(with_cap(eager, {name: cap}), "static:8:10", ref, rs, seeds)  # the same cap as every arm
    out["arms"]["static 8 (reference)"] = {"arm": "static:8:10", **k8}
    for label, gated in (("static, Ray's formation", False), ("static, lazy gate", True)):
        arm, k0, grid = best_static(with_formation(cfg_cap, "eager"), ref, rs, gated)
        held = knee_on_seeds(with_formation(cfg_cap, "eager"), arm, k0, rs, seeds)
        out["arms"][label] = {"arm": arm, **held, "grid": grid}
        say(
            f"  {label:<26} {arm:<20} seed-0 knee {held['seed0_knee_rps']:7.1f}/s  held on {len(seeds)} seeds "
            f"{held['held_knee_rps']:7.1f}/s  ({time.time() - t0:.0f}s)"
        )
    for label, formation in (("broker, Ray's formation", "eager"), ("broker, lazy gate", "lazy")):
        held = knee_on_seeds(with_formation(cfg_cap, formation), "broker", ref, rs, seeds)
        out["arms"][label] = {"arm": f"broker (batch_formation: {formation})", **held}
        say(
            f"  {label:<26} {'broker':<20} seed-0 knee {held['seed0_knee_rps']:7.1f}/s  held on {len(seeds)} seeds "
            f"{held['held_knee_rps']:7.1f}/s  ({time.time() - t0:.0f}s)"
        )
    base = out["arms"]["static 8 (reference)"]["held_knee_rps"] or float("nan")
    for doc in out["arms"].values():
        doc["gain_vs_static8"] = round(doc["held_knee_rps"] / base, 3) if base == base and base > 0 else None
        doc["of_bound"] = round(doc["held_knee_rps"] / out["bound_rps"], 3) if out["bound_rps"] else None
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a one-model profile config, e.g. configs/sim-a20-c0.5.yaml")
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rs = RunSettings(duration_s=args.duration_s, warmup_s=args.warmup_s)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    res = ablation(load_config(args.config), rs, seeds)
    res["config"] = args.config
    print(f"{'arm':<28} {'setting':<30} {'seed-0 knee':>12} {'held knee':>10} {'x static 8':>10} {'of bound':>9}")
    for label, doc in res["arms"].items():
        print(
            f"{label:<28} {doc['arm']:<30} {doc['seed0_knee_rps']:12.1f} {doc['held_knee_rps']:10.1f} "
            f"{doc['gain_vs_static8'] or float('nan'):10.2f} {doc['of_bound'] or float('nan'):9.2f}"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2, default=str))
    return res


if __name__ == "__main__":
    main()
