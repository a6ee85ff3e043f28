"""``gpubroker bench scale``: how the control plane grows with models and cards.

Design note. The broker core (``broker.core.BrokerCore``) runs on a fake clock with synthetic
replica reports, so what is timed is the core's own work, not Ray: every report interval each
replica sends one ``StatsReport`` (arrivals, completions, latency samples, batches, queue,
memory under its grant, the settings version it runs), and every control interval the core
ticks; only ``tick()`` is timed (``time.perf_counter``), reports are timed apart. Load is
synthetic but moving: each model is busy in one phase of four (phases shifted per model), so
models go idle, lend, get busy and reclaim while the clock runs, and lending has work to do.

Cases:

- ``models``: one card, 10 / 100 / 1000 models: median and p99 tick, per-report cost.
- ``cards``: 16 cards x 100 models (100 models in all, 6-7 per card; also 100 per card, 1600
  in all). When the core takes a ``gpus:`` fleet (one ledger per card) this is one core; until
  then it is 16 cores of one card each, and the tick of the cluster is the sum of their 16
  ticks (one broker ticks every card in one control step). ``per_card_core`` in the JSON says
  which ran.
- ``sim``: the simulator (``bench.sim.run_sim``, broker arm) on 100 models x 1 hour of Azure
  trace arrivals (``bench.arrivals``), wall-clock timed.

The result is printed as a table and written to ``bench/out/scale.json``.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.core import BrokerCore, NullMetrics
from broker.types import StatsReport
from quotas.config import FleetConfig, parse_config

GIB = 1024**3
CARD_BYTES = 80 * GIB
REPORT_INTERVAL_S = 0.5
CONTROL_INTERVAL_S = 1.0
TARGETS = {"median_tick_ms": 10.0, "p99_tick_ms": 50.0, "sim_wall_s": 60.0}  # issue 12's bars


def _model(i: int, base: int) -> dict[str, Any]:
    return {
        "model": "profiled",
        "options": {"a_ms": 4 + i % 5, "c_ms": 0.2 + 0.05 * (i % 4), "weights_bytes": base // 4,
                    "bytes_per_item": max(1, base // 256), "unit": "requests"},
        "quota": {"min": base // 2, "base": base, "max": base * 2},
        "batch": {"floor": 2, "ceiling": 128},
        "wait": {"min_ms": 0, "max_ms": 30},
        "slo_p95_ms": 100,
        "max_queued": 1024,
    }


def synthetic_config(n_models: int, capacity_bytes: int = CARD_BYTES, cards: int = 1) -> FleetConfig:
    """``n_models`` profiled models whose bases fill up to 90% of a card's usable; one card (``gpu:``) or
    ``cards`` emulated cards (``gpus:``, each model pinned to card ``i % cards``)."""
    per_card = -(-n_models // cards)  # the most models one card holds
    base = int(capacity_bytes * 0.88 * 0.9) // per_card
    models = {f"m{i:04d}": _model(i, base) for i in range(n_models)}
    doc: dict[str, Any] = {
        "broker": {"control_interval_s": CONTROL_INTERVAL_S, "report_interval_s": REPORT_INTERVAL_S,
                   "metrics_port": 0, "decision_log_size": 2000},
        "models": models,
    }
    if cards == 1:
        doc["gpu"] = {"device": "cpu", "capacity": capacity_bytes}
    else:
        doc["gpus"] = [{"id": f"c{k:02d}", "node": f"n{k // 8}", "index": k % 8, "capacity": capacity_bytes, "device": "cpu"}
                       for k in range(cards)]
        for i, spec in enumerate(models.values()):
            spec["placement"] = {"cards": [f"c{i % cards:02d}"]}
    return parse_config(doc, f"synthetic {n_models} models x {cards} card(s)")


class _Replica:
    """One synthetic replica: its load phase and the settings it last got."""

    def __init__(self, name: str, rid: str, phase: int, settings: dict[str, Any]) -> None:
        self.name, self.rid, self.phase, self.seq = name, rid, phase, 0
        self.settings = settings


def _report(rep: _Replica, now_s: float, step: int, rng: random.Random) -> StatsReport:
    busy = ((step // 60) + rep.phase) % 4 == 0  # busy one 30 s phase in four
    rate = 40.0 if busy else (0.5 if rep.phase % 2 else 0.0)
    arrivals = int(rng.expovariate(1.0) * rate * REPORT_INTERVAL_S) if rate else 0
    cap = int(rep.settings["max_batch_size"])
    batches = tuple((float(min(cap, max(1, arrivals // 2))), 5.0 + 0.3 * min(cap, arrivals)) for _ in range(min(arrivals, 2)))
    grant = int(rep.settings["grant_bytes"])
    used = int(grant * (0.85 if busy else 0.3))
    lat = tuple(round(rng.uniform(8, 60 if busy else 20), 2) for _ in range(min(arrivals, 16)))
    rep.seq += 1
    return StatsReport(
        model=rep.name, replica_id=rep.rid, seq=rep.seq, now_s=now_s, interval_s=REPORT_INTERVAL_S,
        arrivals=arrivals, completions=arrivals, latency_ms=lat, batches=batches,
        batch_requests=tuple(int(b[0]) for b in batches), busy_s=sum(b[1] for b in batches) / 1000.0,
        queue_depth=int(rate // 4) if busy else 0, mem_used_bytes=used, mem_peak_bytes=used,
        device_free_frac=0.3, settings_version=int(rep.settings["version"]),
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class _Cores:
    """One or several cores on one fake clock, driven like replicas drive the live broker."""

    def __init__(self, configs: list[FleetConfig], seed: int) -> None:
        self.t = [1_700_000_000.0]
        clock: Callable[[], float] = lambda: self.t[0]
        self.cores = [BrokerCore(cfg, clock=clock, metrics=NullMetrics()) for cfg in configs]
        self.rng = random.Random(seed)
        self.replicas: list[tuple[BrokerCore, _Replica]] = []
        for c, (core, cfg) in enumerate(zip(self.cores, configs)):
            for i, name in enumerate(cfg.models):
                rid = f"{name}-c{c}-r0"
                cal = {"weights_bytes": int(cfg.models[name].options["weights_bytes"]),
                       "bytes_per_unit": float(cfg.models[name].options["bytes_per_item"]), "cost_unit": "requests"}
                self.replicas.append((core, _Replica(name, rid, i % 4, core.register(name, rid, cal))))

    def run(self, seconds: float) -> dict[str, list[float]]:
        tick_ms: list[float] = []
        report_us: list[float] = []
        steps = int(round(seconds / REPORT_INTERVAL_S))
        per_tick = int(round(CONTROL_INTERVAL_S / REPORT_INTERVAL_S))
        for step in range(steps):
            self.t[0] += REPORT_INTERVAL_S
            started = time.perf_counter()
            for core, rep in self.replicas:
                rep.settings = core.report(_report(rep, self.t[0], step, self.rng))
            report_us.append((time.perf_counter() - started) * 1e6 / max(1, len(self.replicas)))
            if (step + 1) % per_tick == 0:
                started = time.perf_counter()
                for core in self.cores:  # one broker ticks every card in one control step
                    core.tick()
                tick_ms.append((time.perf_counter() - started) * 1000.0)
        return {"tick_ms": tick_ms, "report_us": report_us}


def _summary(label: str, runs: dict[str, list[float]], **extra: Any) -> dict[str, Any]:
    ticks = runs["tick_ms"]
    return {"case": label, **extra, "ticks": len(ticks), "median_tick_ms": round(statistics.median(ticks), 3),
            "p99_tick_ms": round(_percentile(ticks, 0.99), 3), "max_tick_ms": round(max(ticks), 3),
            "report_us": round(statistics.median(runs["report_us"]), 1)}


def per_card_core() -> bool:
    """Does the core hold one ledger per card (a ``gpus:`` fleet, ``status()['cards']``)?"""
    try:
        core = BrokerCore(synthetic_config(4, cards=2), metrics=NullMetrics(), clock=lambda: 0.0)
        return isinstance(core.status().get("cards"), list)
    except Exception:  # noqa: BLE001 - today's core refuses a gpus: fleet (gpu.capacity auto)
        return False


def _timed(configs: list[FleetConfig], seconds: float, seed: int) -> dict[str, list[float]]:
    """Run one report window untimed (the window fills, lending starts), then time ``seconds``."""
    cores = _Cores(configs, seed)
    cores.run(max(m.control.window_s for cfg in configs for m in cfg.models.values()))
    return cores.run(seconds)


def bench_models(counts: tuple[int, ...], seconds: float, seed: int = 0) -> list[dict[str, Any]]:
    rows = []
    for n in counts:
        span = seconds if n <= 100 else seconds / 2  # 1000 models: fewer ticks, same statistics
        rows.append(_summary(f"1 card x {n} models", _timed([synthetic_config(n)], span, seed), cards=1, models=n))
    return rows


def bench_cards(cards: int, models: int, seconds: float, seed: int = 0) -> dict[str, Any]:
    """``models`` models in all over ``cards`` cards (one core per card until the core has cards)."""
    one = per_card_core()
    if one:
        configs = [synthetic_config(models, cards=cards)]
    else:
        per = [models // cards + (1 if k < models % cards else 0) for k in range(cards)]
        configs = [synthetic_config(n) for n in per if n > 0]
    runs = _timed(configs, seconds, seed)
    return _summary(f"{cards} cards x {models} models", runs, cards=cards, models=models, per_card_core=one,
                    cores=len(configs))


def bench_sim(models: int = 100, duration_s: float = 3600.0, rate_rps: float = 0.5, seed: int = 0) -> dict[str, Any]:
    """The simulator's broker arm on ``models`` x ``duration_s`` of trace arrivals, wall-clock timed."""
    from bench.sim import run_sim

    cfg = synthetic_config(models)
    started = time.perf_counter()
    result = run_sim(cfg, "broker", {name: rate_rps for name in cfg.models}, duration_s, arrivals="trace", seed=seed)
    wall = time.perf_counter() - started
    per_model = list(result.models.values())
    return {"case": f"simulator: {models} models x {duration_s / 3600:g} h trace", "models": models,
            "duration_s": duration_s, "rate_rps_per_model": rate_rps, "wall_s": round(wall, 2),
            "offered": sum(m.offered for m in per_model), "completed": sum(m.completed for m in per_model),
            "events": result.events, "attainment": round(statistics.mean(m.attainment for m in per_model), 4)}


def run(quick: bool = False, out: Path = Path("bench/out")) -> dict[str, Any]:
    seconds = 30.0 if quick else 120.0
    rows = bench_models((10, 100) if quick else (10, 100, 1000), seconds)
    cards = [bench_cards(16, 100, seconds)]
    if not quick:
        cards.append(bench_cards(16, 1600, seconds / 4))
    sim = bench_sim(duration_s=300.0 if quick else 3600.0)
    res = {"quick": quick, "seconds_per_case": seconds, "targets": TARGETS, "models": rows, "cards": cards, "sim": sim,
           "per_card_core": cards[0]["per_card_core"]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
    return res


def table(res: dict[str, Any]) -> str:
    lines = ["| case | cores | ticks | median tick ms | p99 tick ms | max tick ms | report µs |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in res["models"] + res["cards"]:
        lines.append(f"| {row['case']} | {row.get('cores', 1)} | {row['ticks']} | {row['median_tick_ms']:.2f} | "
                     f"{row['p99_tick_ms']:.2f} | {row['max_tick_ms']:.2f} | {row['report_us']:.0f} |")
    sim = res["sim"]
    lines.append("")
    lines.append(f"{sim['case']}: {sim['wall_s']:.1f} s wall (target under {TARGETS['sim_wall_s']:.0f} s)")
    if not res["per_card_core"]:
        lines.append("The core has one card today: the 16-card rows run 16 one-card cores and time the sum of their ticks.")
    return "\n".join(lines)
