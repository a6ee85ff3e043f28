"""The ablation on the live stack (Ray Serve, CPU): formation × control for the profiled model.

The four arms of ``bench.ablation`` (the simulator's), live, on the ×``time_scale`` profiled
emulation (a = 200 ms, c = 5 ms at ×10), at one cap:

- ``static, Ray's formation``: a fleet model pinned static (``control.strategy: static``);
- ``static, lazy gate``: the same pin, deployed as ``bench.gated_static.GatedStaticModel``;
- ``broker, Ray's formation``: the broker with ``broker.batch_formation: eager``;
- ``broker, lazy gate``: the broker as it ships.

The static setting is the simulator's best static arm for that formation
(``--sim-json``, from ``python -m bench.ablation``; its wait scaled by ``time_scale``). Each
knee is searched on seed 0 (``bench.scenarios.live_knee``) and then held on every seed
(``gpubroker.sim.knee.held_search``): both are reported. Run::

    .venv/bin/python -m bench.ablation_live --sim-json bench/out/ablation-sim-a20.json \
        --cap-ms 697 --out bench/out/ablation-live.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench import scenarios as sc
from bench.live_runs import Opts, profiled_workload, run_arm, say_row
from gpubroker.sim.knee import HELD_BISECT, HOLD_RUNS_PER_SEED, held_search


def _static_from_sim(doc: dict[str, Any], label: str) -> tuple[int, float]:
    parts = doc["arms"][label]["arm"].split(":")  # static:B:W[:gate]
    return int(parts[1]), float(parts[2])


def arm_knee(target: Any, w: Any, cap: float, o: Opts, start: float, label: str, max_runs: int) -> dict[str, Any]:
    k0, rows = sc.live_knee(
        lambda r: run_arm(target, w.model, r, 0, cap, o, w.body),
        start,
        step=1.15,
        bisect_iters=1,
        max_runs=max_runs,
        on_row=say_row(o, label),
    )
    tried: list[dict[str, Any]] = []

    def passes(rate: float, seed: int) -> bool:
        m = run_arm(target, w.model, rate, seed, cap, o, w.body)
        row = m.row()
        tried.append(row)
        say_row(o, f"{label} s{seed}")(row)
        return m.passes

    held = held_search(passes, k0, o.seeds, max_runs=HOLD_RUNS_PER_SEED * len(o.seeds), bisect_iters=HELD_BISECT)
    return {
        "seed0_knee_rps": k0,
        "held_knee_rps": held.rate if held.resolved else None,  # None: the budget ran out first
        "held_resolved": held.resolved,
        "held_below_rps": held.below_rps,
        "rows": rows,
        "seed_rows": tried,
    }


def _held_text(doc: dict[str, Any]) -> str:
    if doc["held_knee_rps"] is None:
        return f"not held above {doc['held_below_rps']:.1f}/s"
    return f"{doc['held_knee_rps']:6.1f}/s"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sim-json", required=True, help="bench.ablation's result for configs/sim-a20-c0.5.yaml")
    ap.add_argument(
        "--cap-ms", type=float, default=697.0, help="P95 cap (default 1.2 x S = 581 ms of the last seed run)"
    )
    ap.add_argument("--time-scale", type=float, default=10.0)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--max-runs", type=int, default=5, help="runs per seed-0 knee search")
    ap.add_argument("--arms", default="static-eager,static-gate,broker-eager,broker-gate")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from bench.gated_static import GatedStaticModel

    sim = json.loads(Path(args.sim_json).read_text())
    k = args.time_scale
    w = profiled_workload(k)
    o = Opts.make(False, time_scale=k, peer=False, log=lambda m: print(m, flush=True))
    o.seeds = tuple(int(s) for s in args.seeds.split(","))
    cap = args.cap_ms
    arms = {
        "static-eager": ("static, Ray's formation", "eager", _static_from_sim(sim, "static, Ray's formation"), None),
        "static-gate": ("static, lazy gate", "lazy", _static_from_sim(sim, "static, lazy gate"), GatedStaticModel),
        "broker-eager": ("broker, Ray's formation", "eager", None, None),
        "broker-gate": ("broker, lazy gate", "lazy", None, None),
    }
    res: dict[str, Any] = {
        "scenario": "ablation-live",
        "machine": sc.machine_info(),
        "workload": w.label,
        "cap_ms": cap,
        "seeds": list(o.seeds),
        "sim_json": args.sim_json,
        "arms": {},
    }
    t0 = time.time()
    with sc.Stack(direct_ingress=o.direct) as stack:
        for key in args.arms.split(","):
            label, formation, static, cls = arms[key]
            spec = w.spec(cap)
            if static is not None:
                spec = sc.pin_static(spec, static[0], static[1] * k)
            text = sc.fleet_yaml(
                {w.model: spec}, broker_name=f"bench-abl-{key}-{int(time.time()) % 10**6}", http_port=stack.port
            )
            text = text.replace("broker:\n", f"broker:\n  batch_formation: {formation}\n", 1)
            sim_arm = sim["arms"][label]
            start = max(1.0, 0.8 * sim_arm["seed0_knee_rps"] / k)  # the simulator's knee, scaled, a step under
            tgt = stack.deploy_fleet(text, app=f"fleet-abl-{key}", warm_models={w.model: w.body}, model_cls=cls)
            try:
                doc = arm_knee(tgt, w, cap, o, start, label, args.max_runs)
            finally:
                tgt.delete()
            doc.update(
                setting=f"static:{static[0]}:{static[1] * k:g}" if static else f"broker ({formation})",
                sim_seed0_knee_rps=sim_arm["seed0_knee_rps"] / k,
                sim_held_knee_rps=sim_arm["held_knee_rps"] / k,
            )
            res["arms"][label] = doc
            print(
                f"[ablation-live] {label:<26} {doc['setting']:<18} seed-0 knee {doc['seed0_knee_rps']:6.1f}/s  "
                f"held {_held_text(doc)}  (sim, scaled: {doc['sim_seed0_knee_rps']:.1f} / "
                f"{doc['sim_held_knee_rps']:.1f})  {time.time() - t0:.0f}s",
                flush=True,
            )
    res["runtime_s"] = round(time.time() - t0, 1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return res


if __name__ == "__main__":
    main()
