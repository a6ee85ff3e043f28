"""``python -m bench matrix``: the broker against the settings a user would pick, over a load matrix.

Every cell of ``gpubroker.sim.loads`` (fleet x arrival process x load level, a fresh seed each)
runs these arms on the same requests, under one rule (lazy batch formation at the replica's
gate, late requests shed, one request timeout; ``gpubroker.sim.loads.fleet_config``):

- ``broker``: the broker, lending on;
- ``broker-fixed``: the broker with every quota pinned at its base;
- ``fixed-batch``: each model's largest batch that fits its base, wait 10 ms (what a user sets);
- the oracle: the best of a grid of static settings searched per cell (each model's batch at a
  share of the batch its base holds, x a wait up to the fleet's ``wait.max_ms``; one share for
  every model of the cell), the fixed batch included.

Each arm's score is the fleet's goodput within SLO (requests answered within their model's
SLO per second). The JSON holds aggregates per cell (no per-request records), the seeds, the
capacity rule and the targets as distributions: min / median / max over cells.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.matrix_bento import CorkSim
from bench.matrix_static import PerModelStatic
from gpubroker.quotas.config import FleetConfig, parse_config
from gpubroker.sim import loads as L
from gpubroker.sim.engine import SimOptions, Simulator
from gpubroker.sim.profile import profile_for
from gpubroker.sim.types import Arm
from gpubroker.sim.workload import ModelArrivals, finish

WAIT_MS = 10.0  # the fixed batch's wait (Serve's default batch_wait_timeout_s)
# The oracle's batch shares x waits (ms). Its waits stay inside the bounds every arm works under:
# the fleet's wait.max_ms (L.WAIT_MAX_MS) is the user's limit on how long a batch may wait, and
# the broker may not go past it. The 2026-12-06 run searched 30 ms too, and the one cell under
# 0.95 of the oracle was that setting (bench/notes/history.md).
GRID_FULL = ((0.5, 1.0), (2.0, 10.0, L.WAIT_MAX_MS))
GRID_QUICK = ((0.5, 1.0), (2.0, 10.0))
WARMUP_S = 10.0
TARGETS = {
    "broker_vs_fixed_min": 0.98,
    "broker_vs_oracle_min": 0.95,
    "broker_vs_fixed_median_moving": 1.15,
    "lending_vs_quotas_fixed_min": 1.0,
    "lending_vs_quotas_fixed_median_staggered": 1.2,
}


@dataclass(frozen=True)
class Size:
    """How much of the matrix one run covers."""

    duration_s: float
    fleets: tuple[str, ...]
    processes: tuple[str, ...]
    levels: tuple[float, ...]
    grid: tuple[tuple[float, ...], tuple[float, ...]]
    bento: bool = True  # the adaptive batcher at the fixed split (bench.matrix_bento)


FULL = Size(120.0, tuple(L.FLEETS), L.PROCESSES, L.LEVELS, GRID_FULL)
QUICK = Size(60.0, tuple(L.FLEETS), ("poisson", "gamma:4", "onoff", "diurnal"), (0.8, 1.1), GRID_QUICK)


def workload(cfg: FleetConfig, times: Mapping[str, np.ndarray]) -> dict[str, ModelArrivals]:
    return {n: finish(t, profile_for(n, cfg.models[n]), None, 0) for n, t in times.items()}


def run_arm(
    cfg: FleetConfig,
    arm: Arm,
    times: Mapping[str, np.ndarray],
    duration_s: float,
    batches: Mapping[str, int] | None = None,
    static_cls: type[PerModelStatic] = PerModelStatic,
) -> dict:
    """One arm on one cell: fleet goodput within SLO and a few aggregates per model. ``batches``:
    a static arm's batch per model, run by ``static_cls``."""
    cls: type[Simulator] = Simulator
    if batches is not None:
        cls = type("Static", (static_cls,), {"batches": dict(batches)})
    opts = SimOptions(warmup_s=WARMUP_S, drain_s=10.0, batching="lazy")
    res = cls(cfg, arm, workload(cfg, times), duration_s, opts).run()
    return {
        "goodput_rps": round(sum(m.goodput_rps for m in res.models.values()), 3),
        "offered_rps": round(sum(m.offered_rps for m in res.models.values()), 3),
        "models": {
            n: {
                "goodput_rps": round(m.goodput_rps, 3),
                "attainment": round(m.attainment, 4),
                "mean_batch": round(m.mean_batch, 2),
                "ooms": m.ooms,
            }
            for n, m in res.models.items()
        },
        "quota_moves": sum(1 for d in res.decisions if d.get("move")),
    }


def run_cell(fleet: L.FleetDef, process: str, level: float, seed: int, size: Size) -> dict[str, Any]:
    """Every arm on one cell's requests."""
    times = L.times_for(process, fleet, level, size.duration_s, seed)
    lend, fixed = parse_config(L.fleet_config(fleet)), parse_config(L.fleet_config(fleet, fixed=True))
    base = {m.name: m.batch for m in fleet.models}
    arms: dict[str, dict[str, Any]] = {
        "broker": run_arm(lend, Arm("broker"), times, size.duration_s),
        "broker-fixed": run_arm(fixed, Arm("broker"), times, size.duration_s),
        "fixed-batch": run_arm(fixed, Arm("static", 1, WAIT_MS, gated=True), times, size.duration_s, base),
    }
    if size.bento:
        ungated = Arm("static", 1, WAIT_MS)  # its own dispatcher forms batches and cancels late requests
        arms["bentoml-adaptive"] = run_arm(fixed, ungated, times, size.duration_s, base, CorkSim)
    grid: dict[str, float] = {f"1:{WAIT_MS:g}": arms["fixed-batch"]["goodput_rps"]}
    for share in size.grid[0]:
        for wait in size.grid[1]:
            key = f"{share:g}:{wait:g}"
            if key in grid:
                continue
            batches = {n: max(1, int(round(b * share))) for n, b in base.items()}
            grid[key] = run_arm(fixed, Arm("static", 1, wait, gated=True), times, size.duration_s, batches)[
                "goodput_rps"
            ]
    best = max(grid, key=grid.__getitem__)
    arms["oracle"] = {"goodput_rps": grid[best], "setting": best, "grid": grid}
    return {"fleet": fleet.name, "process": process, "level": level, "seed": seed, "arms": arms, **ratios(arms)}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def ratios(arms: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    g = {k: v["goodput_rps"] for k, v in arms.items()}
    return {
        "broker_vs_fixed": _ratio(g["broker"], g["fixed-batch"]),
        "broker_vs_oracle": _ratio(g["broker"], g["oracle"]),
        "lending_vs_quotas_fixed": _ratio(g["broker"], g["broker-fixed"]),
        "broker_vs_bentoml": _ratio(g["broker"], g["bentoml-adaptive"]) if "bentoml-adaptive" in g else None,
    }


def dist(values: list[float]) -> dict[str, float | int | None]:
    """min / median / max (and how many cells) of a ratio."""
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def summarise(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets as distributions over cells, and every cell that misses one."""

    def vals(key: str, keep: Callable[[dict], bool] = lambda _c: True) -> list[float]:
        return [c[key] for c in cells if c[key] is not None and keep(c)]

    moving = lambda c: c["process"] in L.MOVING  # noqa: E731
    staggered = lambda c: c["fleet"] == "staggered"  # noqa: E731
    shared = lambda c: len(c["arms"]["broker"]["models"]) > 1  # noqa: E731 - lending needs two models
    d = {
        "broker_vs_fixed": dist(vals("broker_vs_fixed")),
        "broker_vs_oracle": dist(vals("broker_vs_oracle")),
        "broker_vs_fixed_moving": dist(vals("broker_vs_fixed", moving)),
        "lending_vs_quotas_fixed": dist(vals("lending_vs_quotas_fixed", shared)),
        "lending_vs_quotas_fixed_staggered": dist(vals("lending_vs_quotas_fixed", staggered)),
        "broker_vs_bentoml": dist(vals("broker_vs_bentoml")),  # beside the targets
    }
    checks = {
        "broker_vs_fixed_min": (d["broker_vs_fixed"]["min"], "broker_vs_fixed", lambda _c: True, "min"),
        "broker_vs_oracle_min": (d["broker_vs_oracle"]["min"], "broker_vs_oracle", lambda _c: True, "min"),
        "broker_vs_fixed_median_moving": (d["broker_vs_fixed_moving"]["median"], None, moving, "median"),
        "lending_vs_quotas_fixed_min": (d["lending_vs_quotas_fixed"]["min"], "lending_vs_quotas_fixed", shared, "min"),
        "lending_vs_quotas_fixed_median_staggered": (
            d["lending_vs_quotas_fixed_staggered"]["median"],
            None,
            staggered,
            "median",
        ),
    }
    targets: dict[str, dict[str, Any]] = {}
    misses = []
    for name, (value, key, keep, _how) in checks.items():
        goal = TARGETS[name]
        targets[name] = {"target": goal, "value": value, "met": value is not None and value >= goal}
        if key is None:  # a median over cells: what the same cells show beside it
            targets[name]["beside"] = beside([c for c in cells if keep(c)])
            continue
        for c in cells:
            if keep(c) and c[key] is not None and c[key] < goal:
                misses.append({"target": name, "cell": cell_id(c), key: c[key], "cause": cause(c, key)})
    return {"distributions": d, "targets": targets, "misses": misses}


def beside(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """What bounds a median target on these cells: how far the best static setting gets past the
    fixed batch (the room batch and wait leave within the bases), and how often the broker moved quota."""
    room = [
        c["arms"]["oracle"]["goodput_rps"] / c["arms"]["fixed-batch"]["goodput_rps"]
        for c in cells
        if c["arms"]["fixed-batch"]["goodput_rps"] > 0
    ]
    moves = [c["arms"]["broker"]["quota_moves"] for c in cells]
    return {"oracle_vs_fixed": dist([round(x, 4) for x in room]), "quota_moves": dist(moves)}


def cell_id(c: Mapping[str, Any]) -> str:
    return f"{c['fleet']}/{c['process']}/{c['level']:g}/{c['seed']}"


def cause(c: Mapping[str, Any], key: str) -> str:
    """What the aggregates show about a miss: the broker's mean batch, OOMs and moves against the other arm's."""
    other = {"broker_vs_fixed": "fixed-batch", "broker_vs_oracle": "oracle", "lending_vs_quotas_fixed": "broker-fixed"}[
        key
    ]
    b = c["arms"]["broker"]
    if other == "oracle":  # a grid point: no per-model figures, its setting (batch share:wait ms) and its goodput
        o = c["arms"]["oracle"]
        return (
            f"broker vs oracle: goodput {b['goodput_rps']:.1f} vs {o['goodput_rps']:.1f}/s at static setting "
            f"{o['setting']} (share of each base's batch : wait ms), the broker's wait bounded at the fleet's "
            f"wait.max_ms {L.WAIT_MAX_MS:g}; fixed batch {c['arms']['fixed-batch']['goodput_rps']:.1f}/s"
        )
    o = c["arms"][other]
    parts = []
    for n, m in b["models"].items():
        om = o["models"][n]
        parts.append(
            f"{n}: attainment {m['attainment']:.3f} vs {om['attainment']:.3f}, batch {m['mean_batch']:.1f} vs "
            f"{om['mean_batch']:.1f}, OOM {m['ooms']}"
        )
    return f"broker vs {other}: " + "; ".join(parts) + f"; broker quota moves {b['quota_moves']}"


def run(
    *, quick: bool = False, root_seed: int | None = None, size: Size | None = None, out: Path | None = None, say=None
) -> dict[str, Any]:
    """Every cell of the matrix on fresh seeds (``root_seed`` None: drawn now), then the summary."""
    say = say or (lambda _m: None)
    size = size or (QUICK if quick else FULL)
    root = L.fresh_seed() if root_seed is None else int(root_seed)
    t0 = time.perf_counter()
    cells = []
    k = 0
    for fname in size.fleets:
        fleet = L.FLEETS[fname]
        for process in size.processes:
            for level in size.levels:
                seed = int(np.random.SeedSequence([root, k]).generate_state(1)[0])
                k += 1
                c = run_cell(fleet, process, level, seed, size)
                cells.append(c)
                say(
                    f"{cell_id(c)}: broker/fixed {c['broker_vs_fixed']}, /oracle {c['broker_vs_oracle']}, "
                    f"lending/quotas-fixed {c['lending_vs_quotas_fixed']}"
                )
    result = {
        "scenario": "matrix",
        "quick": quick,
        "root_seed": root,
        "seeds": [c["seed"] for c in cells],
        "size": {
            "duration_s": size.duration_s,
            "warmup_s": WARMUP_S,
            "fleets": list(size.fleets),
            "processes": list(size.processes),
            "levels": list(size.levels),
            "oracle_grid": {"batch_shares": list(size.grid[0]), "waits_ms": list(size.grid[1])},
        },
        "rule": "lazy formation at the replica's gate, late requests shed (shed_late), request_timeout_s 10, drain 10 s; "
        "the adaptive batcher forms its own batches and cancels requests that cannot make the SLO",
        "capacity": capacity(size.fleets),
        "cells": cells,
        **summarise(cells),
        "runtime_s": round(time.perf_counter() - t0, 1),
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "matrix.json").write_text(dumps(result), encoding="utf-8")
    return result


def dumps(res: Mapping[str, Any]) -> str:
    """The result as compact JSON (a full run's 144 cells: about 260 kB)."""
    return json.dumps(res, separators=(",", ":"))


def capacity(fleets: tuple[str, ...]) -> dict[str, Any]:
    """The capacity rule and each model's figures: what load level 1.0 offers."""
    out: dict[str, Any] = {
        "rule": "model i at level L offers L x capacity_i / n; capacity_i = 1000 B / (a + c B), B the batch its base holds",
        "fleets": {},
    }
    for f in fleets:
        fleet = L.FLEETS[f]
        n = len(fleet.models)
        out["fleets"][f] = {
            "card_bytes": L.card_bytes(fleet),
            "phase": fleet.phase,
            "models": {
                m.name: {
                    "batch_at_base": m.batch,
                    "base_bytes": m.base_bytes,
                    "capacity_rps": round(m.capacity_rps(), 2),
                    "rate_at_1_rps": round(m.capacity_rps() / n, 2),
                    "slo_ms": m.slo_ms(n),
                }
                for m in fleet.models
            },
        }
    return out


def table(res: Mapping[str, Any]) -> str:
    """The distributions and the misses, as markdown."""
    lines = ["| ratio | cells | min | median | max |", "|---|---|---|---|---|"]
    for k, d in res["distributions"].items():
        if d["n"]:
            lines.append(f"| {k} | {d['n']} | {d['min']:.3f} | {d['median']:.3f} | {d['max']:.3f} |")
    lines += ["", "| target | goal | value | met |", "|---|---|---|---|"]
    for k, t in res["targets"].items():
        v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"| {k} | {t['target']} | {v} | {t['met']} |")
    lines.append(f"\nroot seed {res['root_seed']}; {len(res['cells'])} cells; {res['runtime_s']:.0f} s")
    for m in res["misses"]:
        lines.append(f"- miss {m['target']} {m['cell']}: {m['cause']}")
    return "\n".join(lines)


def heatmap(res: Mapping[str, Any], path: Path) -> Path | None:
    """Broker over the fixed batch per cell (fleets x process and level; the median where a cell
    ran several seeds). None, with nothing written, when matplotlib (the ``[plot]`` extra) is absent."""
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    fleets = res["size"]["fleets"]
    cols = [(p, lv) for p in res["size"]["processes"] for lv in res["size"]["levels"]]
    grid = np.full((len(fleets), len(cols)), np.nan)
    for i, f in enumerate(fleets):
        for j, (p, lv) in enumerate(cols):
            v = [c["broker_vs_fixed"] for c in res["cells"] if (c["fleet"], c["process"], c["level"]) == (f, p, lv)]
            v = [x for x in v if x is not None]
            if v:
                grid[i, j] = statistics.median(v)
    fig, ax = plt.subplots(figsize=(1.0 + 0.55 * len(cols), 1.2 + 0.5 * len(fleets)))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.8, vmax=1.2, aspect="auto")
    for i in range(len(fleets)):
        for j in range(len(cols)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(cols)), [f"{p} {lv:g}" for p, lv in cols], rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(fleets)), fleets, fontsize=8)
    ax.set_title(f"broker / fixed batch, goodput within SLO (root seed {res['root_seed']})", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
