"""What stops the broker short of the fluid bound on the profiled model (simulator).

The bound (1 − 2a/C)/c assumes every batch is the fluid one and the replica is busy all the
time, with no time outside the model. A Poisson load makes batches and queues vary, and the
live serving path adds time to every request. This runs the simulator (the replica's lazy
gate, the broker's policy, Ray's batcher; no HTTP) at the live ``seed`` scenario's profile and
cap, and again with the cap lowered by ``--path-ms`` values (the serving path's time per
request, as ``bench.knee_breakdown`` measures it: lag + in + out), knees held on every seed:

- ``broker``: the broker as it ships (lazy formation);
- ``static:128:0:gate``: one exhaustive lazy queue (every waiting request in the next batch,
  no wait): the most a batch-forming policy can do on this curve without dropping work.

Run (×10 profile of ``bench seed``: a = 200 ms, c = 5 ms, cap 697 ms; the simulator runs it
unscaled, a = 20, c = 0.5, cap 69.7 ms, and the knees are divided by 10)::

    .venv/bin/python -m bench.bound_gap --cap-ms 697 --path-ms 0,30,60 --out bench/out/bound-gap.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gpubroker.sim.knee import RunSettings, bound, knee_on_seeds, with_cap
from quotas.config import load_config

ARMS = ("broker", "static:128:0:gate")


def gap(
    cap_ms: float,
    path_ms: list[float],
    scale: float,
    seeds: tuple[int, ...],
    rs: RunSettings,
    turn_ms: float = 0.0,
    arms: tuple[str, ...] = ARMS,
) -> dict[str, Any]:
    base = load_config("configs/sim-a20-c0.5.yaml")  # a = 20, c = 0.5 ms: the live profile unscaled
    name = next(iter(base.models))
    opts = base.models[name].options
    a0, c = float(opts["a_ms"]), float(opts["c_ms"])
    a = a0 + turn_ms / scale  # idle time between batches costs like a fixed cost per batch
    if turn_ms:
        m = base.models[name]
        base = base.model_copy(update={"models": {name: m.model_copy(update={"options": {**m.options, "a_ms": a}})}})
    cap = cap_ms / scale
    out: dict[str, Any] = {"a_ms": a * scale, "c_ms": c * scale, "cap_ms": cap_ms, "turnaround_ms": turn_ms}
    out.update(seeds=list(seeds), rows=[])
    out["bound_rps"] = bound(a0, c, cap) / scale  # the model's own bound: the path and turnaround are losses
    for d in path_ms:
        eff = cap - d / scale
        row: dict[str, Any] = {"path_ms": d, "turnaround_ms": turn_ms, "model_cap_ms": round(eff * scale, 1)}
        row["bound_rps"] = round(bound(a0, c, eff) / scale, 2)
        cfg = with_cap(base, {name: eff})
        for arm in arms:
            k = knee_on_seeds(cfg, arm, 0.5 * bound(a0, c, eff), rs, seeds)
            row[arm] = {
                "held_rps": round(k["held_knee_rps"] / scale, 2),
                "seed0_rps": round(k["seed0_knee_rps"] / scale, 2),
            }
        row["broker_of_bound"] = round(row["broker"]["held_rps"] / out["bound_rps"], 3)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--cap-ms", type=float, default=697.0, help="the live cap at the ×10 scale")
    ap.add_argument("--path-ms", default="0,30,60", help="serving-path ms per request taken off the cap (×10 scale)")
    ap.add_argument("--scale", type=float, default=10.0)
    ap.add_argument(
        "--turnaround-ms", type=float, default=0.0, help="idle time between batches (×10 scale), added to a"
    )
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--warmup-s", type=float, default=15.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rs = RunSettings(duration_s=a.duration_s, warmup_s=a.warmup_s, batching="eager")
    paths = [float(x) for x in a.path_ms.split(",")]
    seeds = tuple(int(s) for s in a.seeds.split(","))
    res = gap(a.cap_ms, paths, a.scale, seeds, rs, a.turnaround_ms, tuple(a.arms.split(",")))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
