"""``python -m bench.low_load``: what the batch wait costs a fast model at low load, on the simulator.

Two parts, the broker arm only, both batch formations (lazy, the default, and eager):

- **fast**: one model computing in 0.5 ms (``L(b) = 0.4 + 0.1 b`` ms), the config's default wait
  bounds (``wait.max_ms`` 50), SLO 100 ms (the default) and 1000 ms (where the lazy plan's wait
  reaches ``wait.max_ms``), Poisson arrivals at 0.4, 4, 40 and 400 req/s. Where a wait gathers
  nothing it is latency nobody asked for (issue 54 item 7): P50 and P95 against the service time
  and ``wait.max_ms``.
- **saturation**: ``configs/sim-a20-c0.5.yaml`` (``L(b) = 20 + 0.5 b``) at its knee and past it:
  completed rate, mean batch and P95, the throughput-best batch the broker must keep there.

Seeds are drawn fresh (``gpubroker.sim.loads.fresh_seed``) unless ``--seeds`` names them, so a run
before a change and one after it can take the same ones; every seed is in the JSON. The JSON
holds per-run aggregates (no per-request records) and the settings the broker ended on.

    python -m bench.low_load --out bench/out/low-load [--seeds 1,2,3]

and the load matrix on a named root seed, so that a tree before a change and one after it run the
same cells (``python -m bench matrix`` draws its root), then the two runs side by side, reduced to
what the docs quote (distributions and each cell's ratios):

    python -m bench.low_load --matrix-root SEED --out DIR        # DIR/matrix.json, the --quick matrix
    python -m bench.low_load --compare-matrix BEFORE.json AFTER.json --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from gpubroker.quotas.config import BatchFormation, FleetConfig, load_config, parse_config
from gpubroker.sim.engine import SimOptions, run_sim
from gpubroker.sim.loads import fresh_seed

FAST_RATES = (0.4, 4.0, 40.0, 400.0)
FAST_SLOS_MS = (100.0, 1000.0)
SATURATION_RATES = (450.0, 1000.0, 1800.0)  # about the knee at 1.2 S, and past it (1/c = 2000/s)
FORMATIONS = ("lazy", "eager")
WARMUP_S = 10.0
SATURATION_CONFIG = "configs/sim-a20-c0.5.yaml"


def fast_config(formation: str, slo_ms: float = 100.0) -> FleetConfig:
    """One profiled model computing in 0.5 ms a request alone, every bound but the SLO at its default."""
    return parse_config(
        {
            "broker": {"control_interval_s": 1.0, "report_interval_s": 0.5, "batch_formation": formation},
            "gpu": {"device": "cpu", "capacity": "8GiB", "reserve_frac": 0.1},
            "models": {
                "fast": {
                    "model": "profiled",
                    "profile": {"a_ms": 0.4, "c_ms": 0.1, "weights_bytes": "256MiB", "bytes_per_item": "1MiB"},
                    "quota": {"min": "1GiB", "base": "2GiB", "max": "4GiB"},
                    "slo_p95_ms": slo_ms,
                }
            },
        }
    )


def fast_duration_s(rate_rps: float) -> float:
    """Long enough for about 500 requests (a P95 over hundreds), 60 s at least, 1200 s at most."""
    return min(1200.0, max(60.0, 500.0 / rate_rps))


def one_run(cfg: FleetConfig, model: str, rate: float, duration_s: float, seed: int) -> dict[str, Any]:
    """The broker arm on Poisson arrivals: latency, batch and the wait it ran."""
    res = run_sim(cfg, "broker", {model: rate}, duration_s, opts=SimOptions(warmup_s=WARMUP_S, seed=seed, record=False))
    m = res.models[model]
    waits = res.series[model]["wait_ms"]
    tail = waits[len(waits) // 2 :] or waits  # the settings after the first half: where it settled
    mine = [d for d in res.decisions if d.get("model") == model]
    return {
        "seed": seed,
        "rate_rps": rate,
        "duration_s": duration_s,
        "completed": m.completed,
        "completed_rps": round(m.completed_rps, 3),
        "goodput_rps": round(m.goodput_rps, 3),
        "attainment": round(m.attainment, 4),
        "p50_ms": None if m.p50_ms is None else round(m.p50_ms, 3),
        "p95_ms": None if m.p95_ms is None else round(m.p95_ms, 3),
        "p99_ms": None if m.p99_ms is None else round(m.p99_ms, 3),
        "mean_batch": round(m.mean_batch, 2),
        "wait_ms_median_second_half": round(statistics.median(tail), 3) if tail else None,
        "decisions": len(mine),
        "last_reason": str(mine[-1]["reason"]) if mine else "",
    }


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r[key] is not None]
    return round(statistics.median(vals), 3) if vals else None


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over seeds of what the docs quote."""
    keys = ("p50_ms", "p95_ms", "completed_rps", "goodput_rps", "mean_batch", "wait_ms_median_second_half")
    return {k: _median(runs, k) for k in keys}


def run(seeds: list[int], say: Any = print) -> dict[str, Any]:
    t0 = time.perf_counter()
    parts: dict[str, Any] = {"fast": {}, "saturation": {}}
    for formation in FORMATIONS:
        for slo in FAST_SLOS_MS:
            cfg = fast_config(formation, slo)
            for rate in FAST_RATES:
                runs = [one_run(cfg, "fast", rate, fast_duration_s(rate), s) for s in seeds]
                parts["fast"][f"{formation}/slo{slo:g}/{rate:g}"] = {"summary": summary(runs), "runs": runs}
                say(f"fast {formation} slo {slo:g} ms {rate:g}/s: {summary(runs)}")
        sat = load_config(SATURATION_CONFIG)
        broker = sat.broker.model_copy(update={"batch_formation": BatchFormation(formation)})
        sat = sat.model_copy(update={"broker": broker})
        for rate in SATURATION_RATES:
            runs = [one_run(sat, "prof", rate, 60.0, s) for s in seeds]
            parts["saturation"][f"{formation}/{rate:g}"] = {"summary": summary(runs), "runs": runs}
            say(f"saturation {formation} {rate:g}/s: {summary(runs)}")
    return {
        "scenario": "low-load wait",
        "seeds": seeds,
        "fast_profile": {"a_ms": 0.4, "c_ms": 0.1, "service_ms_alone": 0.5, "wait_max_ms": 50.0},
        "saturation_config": SATURATION_CONFIG,
        "warmup_s": WARMUP_S,
        **parts,
        "runtime_s": round(time.perf_counter() - t0, 1),
    }


def compare_matrix(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Two matrix runs on the same root seed, reduced: each ratio's distribution before and after,
    each cell's broker goodput and ratios, and the cells whose broker arms differ."""
    if before["root_seed"] != after["root_seed"] or before["seeds"] != after["seeds"]:
        raise ValueError(
            f"the runs have other seeds (root {before['root_seed']} vs {after['root_seed']}); "
            "run both with --matrix-root on one seed"
        )
    keys = ("broker_vs_fixed", "broker_vs_oracle", "lending_vs_quotas_fixed")
    cells = []
    for b, a in zip(before["cells"], after["cells"], strict=True):
        row: dict[str, Any] = {"cell": f"{b['fleet']}/{b['process']}/{b['level']:g}/{b['seed']}"}
        for arm in ("broker", "broker-fixed"):
            row[arm] = [b["arms"][arm]["goodput_rps"], a["arms"][arm]["goodput_rps"]]
        for k in keys:
            row[k] = [b[k], a[k]]
        cells.append(row)
    changed = [
        c["cell"] for c in cells if c["broker"][0] != c["broker"][1] or c["broker-fixed"][0] != c["broker-fixed"][1]
    ]
    return {
        "root_seed": before["root_seed"],
        "quick": before.get("quick"),
        "distributions": {k: {"before": before["distributions"][k], "after": after["distributions"][k]} for k in keys},
        "cells_changed": changed,
        "cells": cells,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="", help="comma-separated seeds (default: three drawn now)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/low-load"), help="directory for low-load.json")
    ap.add_argument("--label", default="", help="recorded with the run (e.g. before / after)")
    ap.add_argument("--matrix-root", type=int, default=None, help="run the --quick load matrix on this root seed")
    ap.add_argument("--compare-matrix", nargs=2, type=Path, default=None, metavar=("BEFORE", "AFTER"))
    a = ap.parse_args(argv)
    if a.compare_matrix is not None:
        before, after = (json.loads(p.read_text(encoding="utf-8")) for p in a.compare_matrix)
        res = compare_matrix(before, after)
        res["command"] = (
            f"python -m bench.low_load --compare-matrix {a.compare_matrix[0]} {a.compare_matrix[1]} --out {a.out}"
        )
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, separators=(",", ":")), encoding="utf-8")
        print(f"wrote {a.out}: {len(res['cells_changed'])} of {len(res['cells'])} cells changed")
        return
    if a.matrix_root is not None:
        from bench import matrix  # noqa: PLC0415 - only this mode runs it

        res = matrix.run(quick=True, root_seed=a.matrix_root, out=a.out, say=print)
        print(matrix.table(res))
        return
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()] or [fresh_seed() for _ in range(3)]
    res = run(seeds)
    res["label"] = a.label
    res["command"] = "python -m bench.low_load" + (f" --seeds {a.seeds}" if a.seeds else "") + f" --out {a.out}"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "low-load.json").write_text(json.dumps(res, separators=(",", ":")), encoding="utf-8")
    print(f"wrote {a.out / 'low-load.json'} in {res['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
