"""``python -m bench scale``: how the control plane grows with models and cards.

The broker core runs on a fake clock with synthetic, moving replica reports (each model busy in
one phase of four, so models idle, lend, get busy and reclaim); only ``tick()`` and the reports
are timed, not Ray. Cases: ``models`` (one card, 10 / 100 / 1000 models), ``cards`` (16 cards x
100 models, one ``gpubroker.broker.fleet_core.FleetBroker``), ``live`` (the same fleets with the actor's
checkpoint and Prometheus metrics every tick: what a tick costs the live broker) and ``sim`` (the
simulator on 100 models x 1 hour of trace arrivals). ``BUDGET``: a 16 x 100 tick within 50 M
instructions (``bench.tick_instructions``, when valgrind is installed) and a live median within
5 % of ``control_interval_s``. Prints a table and writes ``bench/out/scale.json``.
"""

from __future__ import annotations

import gc
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpubroker.broker.core import BrokerCore, NullMetrics
from gpubroker.broker.wire import ModelSettings, StatsReport
from gpubroker.quotas.config import FleetConfig, parse_config

GIB = 1024**3
CARD_BYTES = 80 * GIB
REPORT_INTERVAL_S = 0.5
CONTROL_INTERVAL_S = 1.0
TARGETS = {"sim_wall_s": 60.0}
# the control tick's budget (issue 35): instructions of a 16 cards x 100 models tick, and its
# median time as a share of the control interval
BUDGET = {"tick_instructions": 50_000_000, "tick_share_of_interval": 0.05}


def _model(i: int, base: int) -> dict[str, Any]:
    return {
        "model": "profiled",
        "options": {
            "a_ms": 4 + i % 5,
            "c_ms": 0.2 + 0.05 * (i % 4),
            "weights_bytes": base // 4,
            "bytes_per_item": max(1, base // 256),
            "unit": "requests",
        },
        "quota": {"min": base // 2, "base": base, "max": base * 2},
        "batch": {"floor": 2, "ceiling": 128},
        "wait": {"min_ms": 0, "max_ms": 30},
        "slo_p95_ms": 100,
        "max_queued": 1024,
    }


def synthetic_doc(n_models: int, capacity_bytes: int = CARD_BYTES, cards: int = 1) -> dict[str, Any]:
    """The YAML document (sizes in bytes) of ``n_models`` profiled models whose bases fill up to
    90% of a card's usable; one card (``gpu:``) or ``cards`` emulated cards (``gpus:``, model
    ``i`` pinned to card ``c<i % cards>``)."""
    per_card = -(-n_models // cards)  # the most models one card holds
    base = int(capacity_bytes * 0.88 * 0.9) // per_card
    models = {f"m{i:04d}": _model(i, base) for i in range(n_models)}
    doc: dict[str, Any] = {
        "broker": {
            "control_interval_s": CONTROL_INTERVAL_S,
            "report_interval_s": REPORT_INTERVAL_S,
            "metrics_port": 0,
            "decision_log_size": 2000,
        },
        "models": models,
    }
    if cards == 1:
        doc["gpu"] = {"device": "cpu", "capacity": capacity_bytes}
    else:
        doc["gpus"] = [
            {"id": f"c{k:02d}", "node": f"n{k // 8}", "index": k % 8, "capacity": capacity_bytes, "device": "cpu"}
            for k in range(cards)
        ]
        for i, spec in enumerate(models.values()):
            spec["placement"] = {"cards": [f"c{i % cards:02d}"]}
    return doc


def synthetic_config(n_models: int, capacity_bytes: int = CARD_BYTES, cards: int = 1) -> FleetConfig:
    """``synthetic_doc`` validated."""
    return parse_config(
        synthetic_doc(n_models, capacity_bytes, cards), f"synthetic {n_models} models x {cards} card(s)"
    )


LOADS = {"busy": 40.0, "trickle": 0.5, "idle": 0.0}  # req/s of the three states a replica moves through


class _Replica:
    """One synthetic replica: its load phase (or one state of ``LOADS`` it keeps) and the
    settings it last got."""

    def __init__(
        self, name: str, rid: str, phase: int, settings: ModelSettings, card_id: str = "", held: str | None = None
    ) -> None:
        self.name, self.rid, self.phase, self.seq, self.card_id = name, rid, phase, 0, card_id
        self.settings, self.held = settings, held


def _report(rep: _Replica, now_s: float, step: int, rng: random.Random) -> StatsReport:
    if rep.held is None:
        busy = ((step // 60) + rep.phase) % 4 == 0  # busy one 30 s phase in four
        rate = 40.0 if busy else (0.5 if rep.phase % 2 else 0.0)
    else:
        busy, rate = rep.held == "busy", LOADS[rep.held]
    arrivals = int(rng.expovariate(1.0) * rate * REPORT_INTERVAL_S) if rate else 0
    cap = rep.settings.max_batch_size
    batches = tuple(
        (float(min(cap, max(1, arrivals // 2))), 5.0 + 0.3 * min(cap, arrivals)) for _ in range(min(arrivals, 2))
    )
    grant = rep.settings.grant_bytes
    used = int(grant * (0.85 if busy else 0.3))
    lat = tuple(round(rng.uniform(8, 60 if busy else 20), 2) for _ in range(min(arrivals, 16)))
    rep.seq += 1
    return StatsReport(
        model=rep.name,
        replica_id=rep.rid,
        seq=rep.seq,
        now_s=now_s,
        interval_s=REPORT_INTERVAL_S,
        arrivals=arrivals,
        completions=arrivals,
        latency_ms=lat,
        batches=batches,
        batch_requests=tuple(int(b[0]) for b in batches),
        busy_s=sum(b[1] for b in batches) / 1000.0,
        queue_depth=int(rate // 4) if busy else 0,
        mem_used_bytes=used,
        mem_peak_bytes=used,
        device_free_frac=0.3,
        settings_version=rep.settings.version,
        card_id=rep.card_id,
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class _Cores:
    """One broker on a fake clock, driven as replicas drive the live one: a ``BrokerCore`` for
    one card, the fleet broker (``gpubroker.broker.fleet_core.FleetBroker``: one core per card, one tick
    for all) for ``gpus:`` fleets, where every replica names its card."""

    def __init__(self, doc: dict[str, Any], seed: int, live_dir: Path | None = None, held: str | None = None) -> None:
        """``live_dir``: run the broker as the actor does (``FleetBroker`` for one card too), its
        checkpoints under this directory and Prometheus metrics on a fresh registry. ``held``:
        every replica keeps that state of ``LOADS`` instead of moving through them."""
        self.t = [1_700_000_000.0]

        def clock() -> float:
            return self.t[0]

        cfg = parse_config(doc, "synthetic")
        self.cards = bool(cfg.gpus) or live_dir is not None
        if self.cards:
            from gpubroker.broker.fleet_core import FleetBroker

            if live_dir is None:
                self.broker: Any = FleetBroker(json.dumps(doc), clock=clock, metrics=NullMetrics())
            else:  # metrics=None: BrokerMetrics on a private registry, as gpubroker.broker.actor builds it
                path = live_dir / "broker.checkpoint.json"
                self.broker = FleetBroker(json.dumps(doc), checkpoint_path=path, clock=clock, metrics=None)
            card_of = {m: self.broker.placement.replicas[m][0] for m in cfg.models}
        else:
            self.broker = BrokerCore(cfg, clock=clock, metrics=NullMetrics())
            card_of = {m: "" for m in cfg.models}
        self.rng = random.Random(seed)
        self.replicas: list[_Replica] = []
        for i, (name, spec) in enumerate(cfg.models.items()):
            rid, card = f"{name}-r0", card_of[name]
            cal = {
                "weights_bytes": int(spec.options["weights_bytes"]),
                "bytes_per_unit": float(spec.options["bytes_per_item"]),
                "cost_unit": "requests",
            }
            settings = self.broker.register(name, rid, cal, card) if card else self.broker.register(name, rid, cal)
            self.replicas.append(_Replica(name, rid, i % 4, settings, card, held))

    def run(self, seconds: float) -> dict[str, list[float]]:
        """``tick_ms`` and ``report_us`` as timed; ``gc_ms``: the cyclic collector's collections
        over the run, wherever the allocations set them off (in a tick or in a report)."""
        tick_ms: list[float] = []
        report_us: list[float] = []
        gc_ms: list[float] = []
        steps = int(round(seconds / REPORT_INTERVAL_S))
        per_tick = int(round(CONTROL_INTERVAL_S / REPORT_INTERVAL_S))
        gc_started = [0.0]

        def timed_gc(phase: str, _info: dict[str, Any]) -> None:
            if phase == "start":
                gc_started[0] = time.perf_counter()
            else:
                gc_ms.append((time.perf_counter() - gc_started[0]) * 1000.0)

        gc.callbacks.append(timed_gc)
        try:
            for step in range(steps):
                self.t[0] += REPORT_INTERVAL_S
                started = time.perf_counter()
                for rep in self.replicas:
                    rep.settings = self.broker.report(_report(rep, self.t[0], step, self.rng))
                report_us.append((time.perf_counter() - started) * 1e6 / max(1, len(self.replicas)))
                if (step + 1) % per_tick == 0:
                    started = time.perf_counter()
                    self.broker.tick()  # one control step for every card
                    tick_ms.append((time.perf_counter() - started) * 1000.0)
        finally:
            gc.callbacks.remove(timed_gc)
        return {"tick_ms": tick_ms, "report_us": report_us, "gc_ms": gc_ms}


def _summary(label: str, runs: dict[str, list[float]], **extra: Any) -> dict[str, Any]:
    ticks = runs["tick_ms"]
    return {
        "case": label,
        **extra,
        "ticks": len(ticks),
        "median_tick_ms": round(statistics.median(ticks), 3),
        "p99_tick_ms": round(_percentile(ticks, 0.99), 3),
        "max_tick_ms": round(max(ticks), 3),
        # the median tick as a share of the control interval (BUDGET)
        "tick_share": round(statistics.median(ticks) / (1000.0 * CONTROL_INTERVAL_S), 5),
        "report_us": round(statistics.median(runs["report_us"]), 1),
        # the collector's time over the run per tick (ticks and reports together)
        "gc_ms_per_tick": round(sum(runs.get("gc_ms", ())) / max(1, len(ticks)), 3),
    }


def _timed(
    doc: dict[str, Any], seconds: float, seed: int, live_dir: Path | None = None, held: str | None = None
) -> tuple[dict[str, list[float]], int]:
    """Run one report window untimed (the window fills, lending starts), then time ``seconds``.
    Returns the timings and how many per-card cores the broker ran. ``held``: as ``_Cores``."""
    cores = _Cores(doc, seed, live_dir, held)
    cores.run(max(float(m.get("control", {}).get("window_s", 30.0)) for m in doc["models"].values()))
    return cores.run(seconds), len(getattr(cores.broker, "cores", {None: None}))


def bench_models(counts: tuple[int, ...], seconds: float, seed: int = 0) -> list[dict[str, Any]]:
    rows = []
    for n in counts:
        span = seconds if n <= 100 else seconds / 2  # 1000 models: fewer ticks, same statistics
        runs, cores = _timed(synthetic_doc(n), span, seed)
        rows.append(_summary(f"1 card x {n} models", runs, cards=1, models=n, cores=cores))
    return rows


def bench_cards(cards: int, models: int, seconds: float, seed: int = 0) -> dict[str, Any]:
    """``models`` models in all over ``cards`` emulated cards, one ``FleetBroker``."""
    runs, cores = _timed(synthetic_doc(models, cards=cards), seconds, seed)
    return _summary(f"{cards} cards x {models} models", runs, cards=cards, models=models, cores=cores)


def bench_live(cards: int, models: int, seconds: float, seed: int = 0) -> dict[str, Any]:
    """``models`` models over ``cards`` cards (one card: ``gpu:``) as the broker actor runs them:
    checkpoints after every tick (a temporary directory, removed after) and Prometheus metrics."""
    with tempfile.TemporaryDirectory(prefix="gpubroker-scale-") as tmp:
        runs, cores = _timed(synthetic_doc(models, cards=cards), seconds, seed, Path(tmp))
        ckpt_bytes = sum(f.stat().st_size for f in Path(tmp).iterdir() if f.suffix == ".json")
    label = f"live: {cards} card{'s' if cards > 1 else ''} x {models} models"
    return _summary(label, runs, cards=cards, models=models, cores=cores, checkpoint_bytes=ckpt_bytes)


def unchanged_share(models: int = 100, cards: int = 16, seconds: float = 120.0, seed: int = 0) -> float:
    """The share of model-ticks whose ``ModelLoad`` equals the model's previous one (report times
    aside): an upper bound on what deciding only the models whose load changed could skip."""
    import dataclasses

    import gpubroker.broker.control.window as bw

    cores = _Cores(synthetic_doc(models, cards=cards), seed)
    cores.run(30.0)
    prev: dict[str, Any] = {}
    counts = [0, 0]  # same, all
    fold = bw.ReportWindow._model_load

    def counting(self: Any, name: str, *args: Any) -> Any:
        load = fold(self, name, *args)
        key = dataclasses.replace(load, replica_reports=())
        counts[0] += prev.get(name) == key
        counts[1] += 1
        prev[name] = key
        return load

    bw.ReportWindow._model_load = counting  # type: ignore[method-assign]
    try:
        cores.run(seconds)
    finally:
        bw.ReportWindow._model_load = fold  # type: ignore[method-assign]
    return counts[0] / max(1, counts[1])


def by_load(models: int = 100, cards: int = 16, seconds: float = 60.0, seed: int = 0) -> dict[str, float]:
    """Microseconds per model-tick (median tick / models) with the fleet's load as ``bench_cards``
    moves it (``mixed``: a quarter busy, the rest idle or a trickle) and with every replica held in
    one state of ``LOADS``: what a model costs the tick in each, side by side in one run."""
    out = {}
    for held in (None, *LOADS):
        runs, _ = _timed(synthetic_doc(models, cards=cards), seconds, seed, held=held)
        out[held or "mixed"] = round(statistics.median(runs["tick_ms"]) * 1000.0 / models, 1)
    return out


def bench_sim(models: int = 100, duration_s: float = 3600.0, rate_rps: float = 0.5, seed: int = 0) -> dict[str, Any]:
    """The simulator's broker arm on ``models`` x ``duration_s`` of trace arrivals, wall-clock timed."""
    from gpubroker.sim.engine import SimOptions, run_sim

    cfg = synthetic_config(models)
    started = time.perf_counter()
    result = run_sim(
        cfg, "broker", {name: rate_rps for name in cfg.models}, duration_s, arrivals="trace", opts=SimOptions(seed=seed)
    )
    wall = time.perf_counter() - started
    per_model = list(result.models.values())
    return {
        "case": f"simulator: {models} models x {duration_s / 3600:g} h trace",
        "models": models,
        "duration_s": duration_s,
        "rate_rps_per_model": rate_rps,
        "wall_s": round(wall, 2),
        "offered": sum(m.offered for m in per_model),
        "completed": sum(m.completed for m in per_model),
        "events": result.events,
        "attainment": round(statistics.mean(m.attainment for m in per_model), 4),
    }


def tick_budget(cards_row: dict[str, Any], quick: bool, say: Any) -> dict[str, Any]:
    """The 16 x 100 tick against ``BUDGET``: its instructions (``bench.tick_instructions``: the
    core's tick, None without valgrind) and the median time of ``cards_row``'s tick (the live
    case: with checkpoints and metrics, as the actor ticks) as a share of the control interval."""
    import shutil

    from bench import tick_instructions

    instructions = None
    if shutil.which("valgrind") is not None:
        tree = Path(__file__).resolve().parents[1]
        instructions = tick_instructions.measure(
            tree,
            16,
            100,
            5.0 if quick else 20.0,
            say=say,
            control_interval_s=CONTROL_INTERVAL_S,
            report_interval_s=REPORT_INTERVAL_S,
        )["per_tick"]
    share = cards_row["tick_share"]
    return {
        "case": cards_row["case"],
        "tick_instructions": instructions,  # None: valgrind is not installed
        "tick_share": share,
        "within": (instructions is None or instructions <= BUDGET["tick_instructions"])
        and share <= BUDGET["tick_share_of_interval"],
        **{f"budget_{k}": v for k, v in BUDGET.items()},
    }


def run(quick: bool = False, out: Path = Path("bench/out"), on_progress: Any = None) -> dict[str, Any]:
    """Every case in turn; ``on_progress(line)`` hears each as it starts and ends."""
    say = on_progress or (lambda _m: None)
    seconds = 30.0 if quick else 120.0

    def case(label: str, fn: Any, *args: Any) -> Any:
        say(f"{label} ...")
        started = time.perf_counter()
        res = fn(*args)
        say(f"{label}: done in {time.perf_counter() - started:.0f} s")
        return res

    rows = [
        r
        for n in ((10, 100) if quick else (10, 100, 1000))
        for r in case(f"1 card x {n} models", bench_models, (n,), seconds)
    ]
    cards = [case("16 cards x 100 models", bench_cards, 16, 100, seconds)]
    if not quick:
        cards.append(case("16 cards x 1600 models", bench_cards, 16, 1600, seconds / 4))
    live = [
        case("live: 1 card x 100 models", bench_live, 1, 100, seconds),
        case("live: 16 cards x 100 models", bench_live, 16, 100, seconds),
    ]
    budget = case("budget: 16 cards x 100 models", tick_budget, live[1], quick, say)
    duration = 300.0 if quick else 3600.0
    sim = case(f"simulator: 100 models x {duration / 3600:g} h of trace", bench_sim, 100, duration)
    res = {
        "quick": quick,
        "seconds_per_case": seconds,
        # the interpreter's build is part of the speed (docs/BENCHMARKS.md, "Which CPython runs the broker")
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "build": platform.python_build(),
        },
        "targets": TARGETS,
        "budget": budget,
        "models": rows,
        "cards": cards,
        "live": live,
        "sim": sim,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
    return res


def table(res: dict[str, Any]) -> str:
    lines = [
        "| case | cores | ticks | median tick ms | p99 tick ms | max tick ms | report µs | gc ms/tick |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in res["models"] + res["cards"] + res.get("live", []):
        lines.append(
            f"| {row['case']} | {row.get('cores', 1)} | {row['ticks']} | {row['median_tick_ms']:.2f} | "
            f"{row['p99_tick_ms']:.2f} | {row['max_tick_ms']:.2f} | {row['report_us']:.0f} | "
            f"{row.get('gc_ms_per_tick', float('nan')):.2f} |"
        )
    sim = res["sim"]
    py = res.get("python")
    lines.append("")
    if "budget" in res:
        lines.append(_budget_line(res["budget"]))
    if py:
        lines.append(f"Python {py['version']} ({py['executable']}, build {' '.join(py['build'])})")
    lines.append(f"{sim['case']}: {sim['wall_s']:.1f} s wall (target under {TARGETS['sim_wall_s']:.0f} s)")
    lines.append(
        "Tick: one control step of the whole broker (a gpus: fleet: FleetBroker.tick, every card's core); "
        "report: one replica report, median. live: as the broker actor runs, with its checkpoint "
        "written after every tick and its Prometheus metrics. gc ms/tick: the cyclic garbage collector's "
        "time over the run per tick (in ticks and reports)."
    )
    return "\n".join(lines)


def _budget_line(b: dict[str, Any]) -> str:
    instr = b["tick_instructions"]
    counted = "not counted (no valgrind)" if instr is None else f"{instr / 1e6:.1f} M instructions"
    return (
        f"Budget, {b['case']}: {counted} (at most {b['budget_tick_instructions'] / 1e6:.0f} M); median tick "
        f"{100 * b['tick_share']:.2f} % of the control interval (at most {100 * b['budget_tick_share_of_interval']:.0f} %): "
        + ("within" if b["within"] else "OVER")
    )
