"""``python -m bench matrix --live``: the live subset of the load matrix on Ray Serve (issue 51).

The simulator's matrix (``bench.matrix``) says how the policy fares over loads nobody tuned
for; this subset checks, on the real stack, the two cells a claim leans on:

- **one model under a varying load** (``ONE``): the memory-bound model of
  ``gpubroker.sim.loads`` (its base holds a batch of exactly ``B = 8``) under a diurnal ramp and
  gamma gaps with CV 4. Arms: ``broker``; ``fixed-batch``, the batch that fits its base (Serve's
  ``@serve.batch`` at cap ``B``, wait 10 ms x the time scale: the fleet's replica pinned with
  ``control.strategy: static``); ``bentoml``, the real BentoML (``bench.peer``) at the same cap
  ``B``, its ``max_latency_ms`` the deadline every arm has.
- **three models on one emulated card** (``CARD``): the ``staggered`` and ``together`` fleets
  of ``gpubroker.sim.loads`` under on/off bursts. Arms: ``broker`` (lending), ``broker-fixed``
  (quotas pinned at base), ``fixed-batch``.

Loads and fleets are the simulator's, moved onto the live emulation with the time scale k
(``bench.scenarios_live``): ``loads.times_for`` draws a cell's arrivals over ``duration / k``
simulated seconds and every time is multiplied by k, so rates fall by k; the profile's a and c,
the SLO, the batch wait bound and the broker's idle and reclaim holds are multiplied by k.
Memory is divided by ``MEM_SCALE`` (host RSS stands in for VRAM and the emulation touches every
page of a batch's scratch: a 512 MiB item would cost real CPU on 2 cores); every ratio of
bytes, so every batch a grant holds, is unchanged.

One rule for every arm (BENCHMARK.md): the same SLO per model, the same deadline
(``ArmRules``: 5 SLOs, a late answer a miss), no arm sheds (a static arm cannot). The score is
goodput within SLO (requests answered within their model's SLO per second, in the measured
window). A run draws a fresh seed (``gpubroker.sim.loads.fresh_seed``), records it, and runs
every arm on the same arrivals; the arm order rotates by one between runs. The JSON keeps
aggregates per run and cell (no per-request records) and min / median / max of every ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench import loadgen as lg
from bench import scenarios as sc
from bench.live_runs import Opts, Workload, fleet_target, start_peer
from bench.tagged import TAGGED
from gpubroker.sim import loads as L
from gpubroker.sim.knee import ArmRules

# Share of the fleet's capacity per part (gpubroker.sim.loads: computed from the nominal profiles).
# One model at 0.5: live its batch of 8 costs about 14 ms a request, not 10 (the emulation touches
# each 4 MiB item's pages on a loaded host), so its real capacity is about 0.8 of the nominal one;
# two --quick runs at 0.95 (diurnal) and 0.8 (gamma CV 4) offered more than that in the window and
# every arm, BentoML and the fixed batch too, scored 0-1.3 of 29-38 req/s: the cell measured only
# the backlog's collapse under a deadline nobody sheds before. Three models at 0.8: on the emulated
# card each model sleeps in its own replica (the card's compute is not shared, unlike the
# simulator's), so each runs at 0.8 / 3 of its own capacity between bursts.
LEVELS = {"one": 0.5, "card": 0.8}
MEM_SCALE = 128  # bytes of the simulator's fleets / this: 1 GiB weights -> 8 MiB, 512 MiB items -> 4 MiB
IDLE_S = 5.0  # between two cells on the BentoML peer, which reports no queue
# Every live quota (and the card) also holds the replica's own runtime: the fixed part a live replica
# holds above its declared weights (Python, Ray, its queue; host RSS counts it, a GPU's memory would
# not). Measured by the broker on --quick runs at 8 MiB of weights: 16.0-19.1 MiB (fixed_bytes); without
# it a base of weights + 8 items held 4 live, the fixed batch 8 ran out of memory 29 times in 30 s and
# the broker's ceiling was 2-6. With 14 MiB a base holds 8 items beside a fixed part of up to 22 MiB.
RUNTIME_BYTES = 14 * 1024**2
WAIT_MS = 10.0  # the fixed batch's wait before the time scale (Serve's default batch_wait_timeout_s)
ONE_ARMS = ("broker", "fixed-batch", "bentoml")
CARD_ARMS = ("broker", "broker-fixed", "fixed-batch")
TARGETS = {  # issue 51: (ratio, part, statistic over runs and cells, goal)
    "broker_vs_bentoml_min": ("broker_vs_bentoml", "one", "min", 1.1),
    "broker_vs_fixed_min": ("broker_vs_fixed", None, "min", 0.98),
    "lending_vs_quotas_fixed_min": ("lending_vs_quotas_fixed", "card", "min", 1.0),
}


@dataclass(frozen=True)
class LiveSize:
    """How much of the live subset one command runs; times in live seconds."""

    runs: int  # each with its own fresh seed and the arm order rotated by one
    one_s: float  # one schedule of a one-model cell
    card_s: float  # one schedule of a three-model cell (a staggered one at least a full cycle: ``card_duration_s``)
    warmup_s: float  # dropped from the front of every schedule (the adaptive arms follow the load)
    cooldown_s: float  # dropped from its end
    one_processes: tuple[str, ...]
    card_fleets: tuple[str, ...]  # fleets of gpubroker.sim.loads, each under on/off bursts

    def card_duration_s(self, fleet: L.FleetDef, k: float) -> float:
        """A three-model cell's schedule: ``card_s``, and for staggered bursts at least one cycle
        (each model's slot of ``loads.SLOT_S`` simulated seconds in turn, x k), so every model bursts."""
        cycle = L.SLOT_S * max(len(fleet.models), 2) * k if fleet.phase == "staggered" else 0.0
        return max(self.card_s, cycle)

    def expected_s(self, k: float, deploy_s: float = 40.0) -> float:
        """Rough wall time: per run, a deployment per arm and every schedule on it (plus 10 s of idling)."""
        one = len(ONE_ARMS) * (deploy_s + len(self.one_processes) * (self.one_s + 10.0))
        card_s = sum(self.card_duration_s(L.FLEETS[f], k) + 10.0 for f in self.card_fleets)
        return self.runs * (one + len(CARD_ARMS) * (deploy_s + card_s))


FULL = LiveSize(3, 180.0, 300.0, 30.0, 5.0, ("diurnal", "gamma:4"), ("staggered", "together"))
# a smoke test of the plumbing: 30 s live are 3 simulated seconds, too short for a diurnal day or a
# staggered cycle (and likely to hold no burst at all), so it takes the stationary gamma gaps
QUICK = LiveSize(1, 30.0, 30.0, 8.0, 2.0, ("gamma:4",), ("together",))


# -- pure parts: seeds, rotation, the live fleet, the schedules, the aggregates ----------------


def draw_seeds(runs: int, draw: Callable[[], int] = L.fresh_seed) -> list[int]:
    """One fresh seed per run, drawn now (never a fixed list); distinct."""
    seeds: list[int] = []
    while len(seeds) < runs:
        s = int(draw())
        if s not in seeds:
            seeds.append(s)
    return seeds


def rotated(arms: Sequence[str], run: int) -> list[str]:
    """The arm order of run ``run``: rotated by one per run, so each arm goes first in turn."""
    k = run % len(arms)
    return list(arms[k:]) + list(arms[:k])


def cell_seed(run_seed: int, index: int) -> int:
    """A cell's seed, derived from its run's (recorded beside it)."""
    return int(np.random.SeedSequence([run_seed, index]).generate_state(1)[0])


def live_models(
    fleet: L.FleetDef, k: float, rules: ArmRules, *, fixed: bool = False, static: bool = False
) -> dict[str, dict[str, Any]]:
    """The fleet's model entries for the live stack (module docstring: times x k, bytes / MEM_SCALE).
    ``fixed``: quotas pinned at base; ``static``: also every batch pinned at its base's ``B``."""
    doc = L.fleet_config(fleet, fixed=fixed or static)
    out: dict[str, dict[str, Any]] = {}
    for m in fleet.models:
        s = doc["models"][m.name]
        slo = round(float(s["slo_p95_ms"]) * k, 3)
        spec: dict[str, Any] = {
            "model": TAGGED["profiled"],
            "options": {
                "a_ms": m.a_ms * k,
                "c_ms": m.c_ms * k,
                "weights_bytes": s["options"]["weights_bytes"] // MEM_SCALE,
                "bytes_per_item": s["options"]["bytes_per_item"] // MEM_SCALE,
                "unit": "requests",
            },
            "quota": live_quota(m, s["quota"], fleet, pinned=fixed or static),
            "batch": dict(s["batch"]),
            "wait": {"min_ms": 0, "max_ms": float(s["wait"]["max_ms"]) * k},
            "slo_p95_ms": slo,
            "max_queued": s["max_queued"],
            "request_timeout_s": rules.deadline_s(slo),
            "shed_late": rules.shed,
            "control": {key: float(s["control"][key]) * k for key in ("idle_hold_s", "reclaim_hold_s")},
        }
        out[m.name] = sc.pin_static(spec, m.batch, WAIT_MS * k) if static else spec
    return out


def live_base(m: L.ModelDef) -> int:
    """A model's live base: its simulated base / ``MEM_SCALE``, plus the replica's runtime."""
    return m.base_bytes // MEM_SCALE + RUNTIME_BYTES


def live_quota(m: L.ModelDef, sim: Mapping[str, int], fleet: L.FleetDef, *, pinned: bool) -> dict[str, int]:
    """min / base / max live: each simulated bound / ``MEM_SCALE`` plus the runtime; ``pinned``: all at
    the base; else max is the whole card, as the simulator's lending fleet has it."""
    base = live_base(m)
    if pinned:
        return {"min": base, "base": base, "max": base}
    return {"min": int(sim["min"]) // MEM_SCALE + RUNTIME_BYTES, "base": base, "max": card_bytes(fleet)}


def card_bytes(fleet: L.FleetDef) -> int:
    """The emulated card: exactly the sum of the live bases (reserve 0), as the simulator's card
    leaves its usable share at the sum of the bases."""
    return sum(live_base(m) for m in fleet.models)


def live_times(
    process: str, fleet: L.FleetDef, level: float, duration_s: float, seed: int, k: float
) -> dict[str, np.ndarray]:
    """Every model's arrival times over ``duration_s`` live seconds: the simulator's cell at ``level``
    over ``duration_s / k`` seconds, every time x k."""
    return {n: t * k for n, t in L.times_for(process, fleet, level, duration_s / k, seed).items()}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def cell_ratios(part: str, arms: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """The ratios of one cell of one run, from each arm's goodput within SLO (None: an arm failed)."""
    g = {a: d.get("goodput_rps") for a, d in arms.items()}
    out = {"broker_vs_fixed": ratio(g.get("broker"), g.get("fixed-batch"))}
    if part == "one":
        out["broker_vs_bentoml"] = ratio(g.get("broker"), g.get("bentoml"))
    else:
        out["lending_vs_quotas_fixed"] = ratio(g.get("broker"), g.get("broker-fixed"))
    return out


def dist(values: Sequence[float]) -> dict[str, Any]:
    """min / median / max (and how many values) of a ratio."""
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def summarise(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every ratio's distribution over runs, per cell and over all cells; the targets against them."""
    per_cell: dict[str, dict[str, list[float]]] = {}
    overall: dict[str, list[float]] = {}
    by_part: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        for c in r["cells"]:
            for key, v in c["ratios"].items():
                if v is None:
                    continue
                per_cell.setdefault(c["cell"], {}).setdefault(key, []).append(v)
                overall.setdefault(key, []).append(v)
                by_part.setdefault((c["part"], key), []).append(v)
    targets = {}
    for name, (key, part, stat, goal) in TARGETS.items():
        vals = overall.get(key, []) if part is None else by_part.get((part, key), [])
        value = dist(vals)[stat]
        targets[name] = {"target": goal, "value": value, "met": value is not None and value >= goal, "n": len(vals)}
    return {
        "distributions": {
            "per_cell": {c: {k: dist(v) for k, v in d.items()} for c, d in per_cell.items()},
            "overall": {k: dist(v) for k, v in overall.items()},
        },
        "targets": targets,
    }


def arm_doc(m: sc.Measurement, moves: int | None, final: Mapping[str, Any] | None) -> dict[str, Any]:
    """One arm on one cell, as aggregates: fleet goodput within SLO and a few figures per model."""
    models = {}
    for n, s in m.summary.items():
        st = (final or {}).get("models", {}).get(n, {})
        models[n] = {
            "offered_rps": round(s.offered_rps, 3),
            "goodput_rps": round(s.goodput_rps, 3),
            "attainment": round(s.attainment, 4),
            "p95_ms": s.p95_ms,
            "slo_ms": s.cap_ms,
            "timeouts": s.timeouts,
            "rejections": s.rejections,
            "errors": s.errors,
            "mean_batch": None if m.batch[n]["mean_batch"] is None else round(m.batch[n]["mean_batch"], 2),
            "ooms": st.get("oom_splits"),
            "emergency_shrinks": st.get("emergency_shrinks"),
            "memory_ceiling_end": st.get("memory_ceiling"),  # the batch its grant held at the end, by the broker
            "fixed_bytes_end": st.get("fixed_bytes"),  # the fixed part the broker measured against the grant
            "max_batch_size_seen": (m.extra.get("settings", {}).get(n) or {}).get("max_batch_size"),
        }
    return {
        "goodput_rps": round(m.goodput_rps, 3),
        "offered_rps": round(sum(s.offered_rps for s in m.summary.values()), 3),
        "quota_moves": moves,
        "models": models,
    }


# -- the live part: one deployment per arm, every cell's schedule on it ------------------------


@dataclass(frozen=True)
class Cell:
    """One cell of one run: its part, fleet and process, and the arrivals every arm gets."""

    part: str  # one | card
    fleet: L.FleetDef
    process: str
    seed: int
    times: Mapping[str, np.ndarray]
    duration_s: float

    @property
    def name(self) -> str:
        return f"{self.part}/{self.fleet.name}/{self.process}"


def cells_of(run_seed: int, size: LiveSize, k: float) -> list[Cell]:
    one = [("one", L.FLEETS["one"], p, size.one_s) for p in size.one_processes]
    card = [("card", L.FLEETS[f], "onoff", size.card_duration_s(L.FLEETS[f], k)) for f in size.card_fleets]
    out = []
    for i, (part, fleet, process, dur) in enumerate(one + card):
        seed = cell_seed(run_seed, i)
        times = live_times(process, fleet, LEVELS[part], dur, seed, k)
        out.append(Cell(part, fleet, process, seed, times, dur))
    return out


def _deploy(stack: sc.Stack, arm: str, fleet: L.FleetDef, k: float, o: Opts) -> Any:
    """The arm's app: a fleet (its own broker) or, for ``bentoml``, the peer at the base's batch."""
    body = lg.default_body("profiled")
    if arm == "bentoml":
        (m,) = fleet.models
        spec = live_models(fleet, k, o.rules)[m.name]
        w = Workload(f"matrix-live {m.name}", m.name, "profiled", spec["options"], m.a_ms * k, m.c_ms * k)
        return start_peer(stack, w, spec["slo_p95_ms"], m.batch, o)
    specs = live_models(fleet, k, o.rules, fixed=arm == "broker-fixed", static=arm == "fixed-batch")
    tag = f"ml{arm.replace('-', '')[:6]}"
    return fleet_target(stack, specs, tag, {n: body for n in specs}, capacity=str(card_bytes(fleet)))


def _measure(target: Any, cell: Cell, size: LiveSize, k: float, o: Opts) -> dict[str, Any]:
    """One arm on one cell's arrivals (the same for every arm), as aggregates."""
    fleet = getattr(target, "kind", "") == "fleet"
    if hasattr(target, "idle"):
        target.idle()
    else:  # BentoML shows no queue: give what a previous cell left behind time to finish
        time.sleep(IDLE_S)
    body = lg.default_body("profiled")
    sched = lg.merge(*[lg.plan(n, t, body) for n, t in cell.times.items()])
    slos = {m.name: round(m.slo_ms(len(cell.fleet.models)) * k, 3) for m in cell.fleet.models}
    seq0 = sc.decisions_since(target, 0, None, kinds=())[1] if fleet else 0
    m = sc.measure(
        target,
        sched,
        cell.duration_s,
        slos,
        warmup_s=size.warmup_s,
        cooldown_s=size.cooldown_s,
        seed=cell.seed,
        poll=fleet,
        timeout_s=o.rules.deadline_s(max(slos.values())) + 1.0,
    )
    moves, final = None, None
    if fleet:
        hi = cell.duration_s - size.cooldown_s
        m.extra["settings"] = {n: lg.settings_seen(m.status_samples, n, size.warmup_s, hi) for n in slos}
        moves = len(sc.decisions_since(target, seq0, None, kinds=("move",))[0])
        final = sc.http_json(target.status_url)[1]
    return arm_doc(m, moves, final)


def measure_or_error(target: Any, cell: Cell, size: LiveSize, k: float, o: Opts) -> dict[str, Any]:
    """``_measure``, or the error that ended it (recorded in the cell; a run of hours goes on)."""
    try:
        return _measure(target, cell, size, k, o)
    except Exception as exc:  # noqa: BLE001 - the cell's ratios for this arm are then None
        return {"error": f"measurement failed: {exc!r}"[:400]}


def run_part(stack: sc.Stack, part: str, cells: list[Cell], order: list[str], size: LiveSize, k: float, o: Opts):
    """Every arm of ``part`` in ``order``, each deployed once and run on every cell of the part."""
    todo = [c for c in cells if c.part == part]
    docs: dict[str, dict[str, Any]] = {c.name: {} for c in todo}
    for arm in order:
        try:
            target, deployed = _deploy(stack, arm, todo[0].fleet, k, o), todo[0].fleet
        except Exception as exc:  # noqa: BLE001 - an arm that cannot start is recorded, the run goes on
            o.log(f"[matrix-live] {part} {arm}: did not start: {exc!r}")
            for c in todo:
                docs[c.name][arm] = {"error": repr(exc)[:400]}
            continue
        try:
            for c in todo:
                if c.fleet.models != deployed.models:  # other models: a fresh deployment of the same arm
                    target.delete()
                    target, deployed = _deploy(stack, arm, c.fleet, k, o), c.fleet
                docs[c.name][arm] = d = measure_or_error(target, c, size, k, o)
                got = (
                    f"goodput {d['goodput_rps']:.2f}/s of {d['offered_rps']:.2f}/s" if "error" not in d else d["error"]
                )
                o.log(f"[matrix-live] {c.name} {arm}: {got}")
        finally:
            target.delete()
    return docs


def one_run(stack: sc.Stack, index: int, seed: int, size: LiveSize, k: float, o: Opts) -> dict[str, Any]:
    """Run ``index``: its cells on ``seed``, the arm order rotated by ``index``."""
    cells = cells_of(seed, size, k)
    orders = {"one": rotated(ONE_ARMS, index), "card": rotated(CARD_ARMS, index)}
    arms: dict[str, dict[str, Any]] = {}
    for part, order in orders.items():
        if any(c.part == part for c in cells):
            arms.update(run_part(stack, part, cells, order, size, k, o))
    out = []
    for c in cells:
        ratios = cell_ratios(c.part, arms[c.name])
        out.append({"cell": c.name, "part": c.part, "seed": c.seed, "arms": arms[c.name], "ratios": ratios})
        o.log(f"[matrix-live] run {index} {c.name}: {ratios}")
    return {"run": index, "seed": seed, "arm_order": orders, "cells": out}


def capacity(k: float, size: LiveSize) -> dict[str, Any]:
    """What level 1.0 offers, live: each model's rate and SLO at this time scale."""
    parts = [("one", "one")] if size.one_processes else []
    parts += [("card", f) for f in size.card_fleets]
    out: dict[str, Any] = {"rule": "gpubroker.sim.loads: model i at level L offers L x capacity_i / n; rates / k"}
    for part, f in parts:
        fl = L.FLEETS[f]
        n = len(fl.models)
        out[f] = {
            m.name: {
                "batch_at_base": m.batch,
                "level": LEVELS[part],
                "rate_at_level_rps": round(LEVELS[part] * m.capacity_rps() / n / k, 3),
                "slo_ms": round(m.slo_ms(n) * k, 1),
                "base_bytes": live_base(m),
            }
            for m in fl.models
        }
        out[f]["card_bytes"] = card_bytes(fl)
    return out


def run(*, quick: bool, time_scale: float, say: Callable[[str], None], seeds: Sequence[int] | None = None):
    """Every run of the live subset on fresh seeds (``seeds`` None: drawn now), then the summary."""
    size = QUICK if quick else FULL
    seeds = list(seeds) if seeds is not None else draw_seeds(size.runs)
    o = Opts(quick=quick, time_scale=time_scale, log=say)
    t0 = time.time()
    say(f"[matrix-live] {size.runs} run(s), seeds {seeds}; expected about {size.expected_s(time_scale) / 60:.0f} min")
    runs = []
    with sc.Stack() as stack:
        for i, seed in enumerate(seeds):
            runs.append(one_run(stack, i, seed, size, time_scale, o))
    return {
        "scenario": "matrix-live",
        "quick": quick,
        "time_scale": time_scale,
        "levels": LEVELS,
        "mem_scale": MEM_SCALE,
        "runtime_bytes": RUNTIME_BYTES,
        "seeds": seeds,
        "size": asdict(size),
        "arms": {"one": list(ONE_ARMS), "card": list(CARD_ARMS)},
        "rules": {**o.rules.to_dict(), "score": "goodput within each model's SLO, per second, in the measured window"},
        "capacity": capacity(time_scale, size),
        "machine": sc.machine_info(),
        "runs": runs,
        **summarise(runs),
        "runtime_s": round(time.time() - t0, 1),
    }


def table(res: Mapping[str, Any]) -> str:
    """Each run's ratios, their distributions and the targets, as markdown."""
    lines = ["| run | seed | cell | ratio | value |", "|---|---|---|---|---|"]
    for r in res["runs"]:
        for c in r["cells"]:
            for key, v in c["ratios"].items():
                lines.append(f"| {r['run']} | {r['seed']} | {c['cell']} | {key} | {'n/a' if v is None else v} |")
    lines += ["", "| ratio | runs x cells | min | median | max |", "|---|---|---|---|---|"]
    for key, d in res["distributions"]["overall"].items():
        lines.append(f"| {key} | {d['n']} | {d['min']:.3f} | {d['median']:.3f} | {d['max']:.3f} |")
    lines += ["", "| target | goal | value | met |", "|---|---|---|---|"]
    for key, t in res["targets"].items():
        value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"| {key} | {t['target']} | {value} | {t['met']} |")
    lines.append(f"\n{len(res['runs'])} run(s), seeds {res['seeds']}; {res['runtime_s']:.0f} s")
    return "\n".join(lines)
