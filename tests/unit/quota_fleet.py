"""A fake fleet with measured memory for quota tests through ``BrokerCore`` on a fake clock.

Each fake replica registers, reports what a replica reports (busy or idle, the memory it
holds, the settings version it runs) and keeps the settings it got back. Its memory follows
what enforcement allows: at most the grant share it runs, or what it already held (a replica
whose grant was lowered may keep holding its old memory until it frees it, restarts or dies).
``true_used`` is what the replicas really hold, silent ones included; ``check`` asserts the
invariant sum of max(grant + in flight, used) <= usable (``gpubroker.quotas.holding``) on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpubroker.broker.core import BrokerCore
from gpubroker.broker.wire import StatsReport
from gpubroker.quotas.holding import holding_problems
from gpubroker.quotas.ledger import QuotaLedger

MIB = 1024**2
USABLE = 384 * MIB
CAL = {"hot": (16 * MIB, 4 * MIB), "cold": (16 * MIB, 1 * MIB)}


def config(transfer_timeout_s: float = 60, hot_max: str = "512MiB", replicas: int = 1) -> str:
    return f"""
broker: {{name: qp, namespace: qp, control_interval_s: 1.0, report_interval_s: 0.5, transfer_timeout_s: {transfer_timeout_s}, metrics_port: 0}}
gpu: {{device: cpu, capacity: 384MiB, reserve_frac: 0.0, emergency_free_frac: 0.05}}
models:
  hot:
    model: profiled
    options: {{a_ms: 20, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 4194304}}
    quota: {{min: 64MiB, base: 128MiB, max: {hot_max}}}
    batch: {{floor: 2, ceiling: 64, initial: 4}}
    replicas: {replicas}
    slo_p95_ms: 1500
    control: {{window_s: 4, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}}
  cold:
    model: profiled
    options: {{a_ms: 5, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 1048576}}
    quota: {{min: 64MiB, base: 256MiB, max: 256MiB}}
    batch: {{floor: 2, ceiling: 16}}
    replicas: {replicas}
    slo_p95_ms: 1500
    control: {{window_s: 4, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}}
"""


class Clock:
    """Half-second steps from a round epoch: exact in binary floating point."""

    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Replica:
    model: str
    rid: str
    settings: dict
    used: int = 0
    seq: int = 0
    alive: bool = True
    start_token: int = 0  # restart_token of the settings it started with

    @property
    def share(self) -> int:
        """Its share of the grant it runs."""
        return self.settings["grant_bytes"] // max(1, self.settings.get("_replicas", 1))


@dataclass
class Fleet:
    core: BrokerCore
    clock: Clock
    replicas: int = 1
    restart_on_token: bool = True  # a replica restarts when the broker raises its restart_token
    reps: dict[str, list[Replica]] = field(default_factory=dict)
    serial: int = 0

    def start(self) -> Fleet:
        for name in CAL:
            for _ in range(self.replicas):
                self.add(name, used=20 * MIB)
        return self

    def add(self, name: str, used: int) -> Replica:
        w, per = CAL[name]
        self.serial += 1
        rid = f"{name}-r{self.serial}"
        got = self.core.register(
            name, rid, {"weights_bytes": w, "bytes_per_unit": per, "cost_unit": "requests"}
        ).to_dict()
        rep = Replica(name, rid, {**got, "_replicas": self.replicas}, start_token=got.get("restart_token", 0))
        rep.used = min(used, rep.share)
        self.reps.setdefault(name, []).append(rep)
        return rep

    def live(self, name: str) -> list[Replica]:
        return [r for r in self.reps.get(name, []) if r.alive]

    def report(self, rep: Replica, busy: bool, used: int | None) -> None:
        """One report; ``used`` None holds what it has, else it moves to ``used`` capped at its share."""
        if used is not None:
            rep.used = min(used, rep.share) if used > rep.used else used
        s = rep.settings
        if busy:
            b = s["max_batch_size"]
            body = {
                "arrivals": 20,
                "completions": 20,
                "latency_ms": tuple([200.0] * 20),
                "batches": tuple((float(b), 22.0) for _ in range(5)),
                "batch_requests": tuple(b for _ in range(5)),
                "busy_s": 0.11,
                "queue_depth": 60,
            }
        else:
            body = {}
        msg = {
            "model": rep.model,
            "replica_id": rep.rid,
            "seq": rep.seq,
            "now_s": self.clock(),
            "interval_s": 0.5,
            "mem_used_bytes": rep.used,
            "mem_peak_bytes": rep.used,
            "settings_version": s["version"],
            **body,
        }
        rep.seq += 1
        got = self.core.report(StatsReport.from_dict(msg)).to_dict()
        rep.settings = {**got, "_replicas": self.replicas}
        if self.restart_on_token and got.get("restart_token", 0) > rep.start_token:
            rep.alive = False  # Serve replaces it: the old process and its memory are gone
            self.add(rep.model, used=10 * MIB)

    def report_all(
        self, busy: dict[str, bool], used: dict[str, int | None], silent: frozenset[str] = frozenset()
    ) -> None:
        for name in CAL:
            if name in silent:
                continue
            for rep in self.live(name):
                self.report(rep, busy.get(name, False), used.get(name))

    def true_used(self) -> dict[str, int]:
        return {name: sum(r.used for r in self.live(name)) for name in CAL}


def ledger_of(core: BrokerCore) -> QuotaLedger:
    return core._state.ledger


def check(core: BrokerCore, fleet: Fleet, core_log: bool = True) -> None:
    """The invariant on what the replicas really hold; with ``core_log``, also on the core's own
    measured view (it logs an ``invariant`` decision when that breaks)."""
    led = ledger_of(core)
    led.check()
    problems = holding_problems(led, fleet.true_used())
    assert not problems, problems
    if core_log:
        logged = [d["reason"] for d in core.decisions() if d["kind"] == "invariant"]
        assert not logged, logged


def new_core(path: Path | None, clock: Clock, text: str) -> BrokerCore:
    return BrokerCore(text, capacity_bytes=USABLE, checkpoint=path, clock=clock)


def moves(core: BrokerCore, *kinds: str) -> list[dict]:
    return [d for d in core.decisions() if d["kind"] == "move" and (not kinds or d["move"] in kinds)]
