"""The simulator's vocabulary: arms, emulated replicas and batches, results (see ``gpubroker.sim.engine``)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gpubroker.deployments.replica.gate import LazyGate
from gpubroker.deployments.replica.shed import LateShed
from gpubroker.sim.profile import Profile

START_EPOCH_S = 1_700_000_000.0  # Tue 2023-11-14 22:13 UTC: the default profile's hours

# request status codes
PENDING, DONE, REJECTED, TIMED_OUT, FAILED = 0, 1, 2, 3, 4

# event kinds (ints order ties: completions before timers before reports)
EV_GPU, EV_TIMER, EV_REPORT, EV_CONTROL, EV_SAMPLE = 0, 1, 2, 3, 4
# How @serve.batch forms batches. "eager" is Ray 2.60: its loop forms the next batch as soon as
# a request arrives (first request + batch_wait_timeout_s, or max_batch_size reached), then
# the batch waits for a max_concurrent_batches slot; batches do NOT grow while the replica is
# busy. "lazy" is BENCHMARK.md's quick model: the next batch forms only when a slot is free,
# from everything queued by then (up to the cap). gpubroker's replicas get lazy formation on
# Ray 2.60 by gating requests while a batch runs (deployments/replica/deployment.py, _admit_to_batcher).
BATCHING_MODES = ("eager", "lazy")

LATENCY_SAMPLES_PER_REPORT = 512  # the replica caps the samples it sends; we keep every k-th


@dataclass(frozen=True)
class Arm:
    """What sets the batch knobs: a fixed static setting or the broker's policy."""

    kind: str  # "static" or "broker"
    batch: int = 0  # static: batch cap in requests
    wait_ms: float = 10.0  # static: batch wait timeout
    gated: bool = False  # static: the replica's LazyGate in front of Ray's eager batcher (ablation)

    @property
    def label(self) -> str:
        if self.kind == "broker":
            return "broker"
        return f"static:{self.batch}:{self.wait_ms:g}" + (":gate" if self.gated else "")


POLICY_FORMS = (
    "'broker', 'static:B', 'static:B:WAIT_MS' or 'static:B:WAIT_MS:gate' "
    "(e.g. static:8 or static:32:5; ':gate' puts the lazy gate in front)"
)


def parse_arm(text: str) -> Arm:
    """``broker``, ``static:B`` or ``static:B:WAIT_MS``."""
    t = str(text).strip().lower()
    if t == "broker":
        return Arm("broker")
    parts = t.split(":")
    gated = len(parts) == 4 and parts[3] == "gate"
    if parts[0] == "static" and (len(parts) in (2, 3) or gated):
        try:
            b = int(parts[1])
            w = float(parts[2]) if len(parts) >= 3 else 10.0
        except ValueError:
            b, w = 0, -1.0
        if b >= 1 and w >= 0:
            return Arm("static", b, w, gated)
    raise ValueError(f"policy '{text}' is not known; use {POLICY_FORMS}")


# ---------------------------------------------------------------------------------------------
# Emulated replicas


class SimBatch:
    __slots__ = ("rep", "ids", "chunks", "chunk", "chunk_cost", "chunk_t0", "mem", "start_t")

    def __init__(self, rep: SimReplica, ids: list[int], start_t: float):
        self.rep = rep
        self.ids = ids
        self.chunks: deque[list[int]] = deque([ids])
        self.chunk: list[int] | None = None  # the part running now (None: an OOM attempt)
        self.chunk_cost = 0
        self.chunk_t0 = start_t
        self.mem = 0.0
        self.start_t = start_t


class MemPool:
    """The memory every replica on the emulated card holds now (the sum of their ``mem_now``,
    kept as each changes instead of summed over every replica at every report)."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0.0


class SimReplica:
    __slots__ = (
        "m",
        "name",
        "rid",
        "prof",
        "queue",
        "running",
        "timer_at",
        "timer_ver",
        "max_batch",
        "wait_s",
        "grant",
        "admit",
        "max_ongoing",
        "version",
        "local_cap",
        "floor",
        "mcb",
        "max_queued",
        "timeout_s",
        "_mem",
        "pool",
        "seq",
        "last_report_t",
        "card_busy_mark",
        "busy_acc",
        "st_arr",
        "st_done",
        "st_rej",
        "st_to",
        "st_err",
        "st_lat",
        "st_batches",
        "st_breq",
        "st_peak",
        "st_oom",
        "st_oom_costs",
        "st_emerg",
        "forming",
        "form_cost",
        "formed",
        "gate",
        "paused",
        "held",
        "shed",
        "st_shed",
    )

    def __init__(self, m: int, name: str, rid: str, prof: Profile, spec: Any, pool: MemPool | None = None):
        self.pool = pool if pool is not None else MemPool()  # the card's total, kept as mem_now moves
        self._mem = 0.0
        self.m = m
        self.name = name
        self.rid = rid
        self.prof = prof
        self.queue: deque[int] = deque()
        self.running: list[SimBatch] = []
        self.timer_at = math.inf
        self.timer_ver = 0
        self.max_batch = 1
        self.wait_s = 0.0
        self.grant = math.inf
        self.admit = True
        self.max_ongoing = 0
        self.version = -1
        self.local_cap: int | None = None
        self.floor = spec.batch.floor
        self.mcb = spec.batch.max_concurrent_batches
        self.max_queued = spec.max_queued
        self.timeout_s = spec.request_timeout_s
        self.mem_now = float(prof.weights_bytes)
        self.seq = 0
        self.last_report_t = 0.0
        self.card_busy_mark = 0.0
        self.busy_acc = 0.0
        self.forming: list[int] | None = None  # eager mode: the batch being formed
        self.form_cost = 0
        self.formed: deque[list[int]] = deque()  # eager mode: formed batches waiting for a slot
        self.gate: LazyGate[int] | None = None  # the replica's lazy gate (broker arm, lazy formation)
        self.shed: LateShed | None = None  # shed_late behind the gate (gpubroker.deployments.replica.shed)
        self.paused = False  # the fast loop paused admission
        self.held = 0  # requests admitted and not answered yet (the replica's ``waiting``)
        self._reset_stats()

    @property
    def mem_now(self) -> float:
        return self._mem

    @mem_now.setter
    def mem_now(self, value: float) -> None:
        self.pool.total += value - self._mem
        self._mem = value

    def _reset_stats(self) -> None:
        self.st_arr = self.st_done = self.st_rej = self.st_to = self.st_err = self.st_shed = 0
        self.st_lat: list[float] = []
        self.st_batches: list[tuple[float, float]] = []
        self.st_breq: list[int] = []
        self.st_peak = self.mem_now
        self.st_oom = 0
        self.st_oom_costs: list[float] = []
        self.st_emerg = 0


@dataclass
class ModelResult:
    """Per-model outcome over requests that arrived in [warmup_s, duration_s)."""

    model: str
    cap_ms: float  # latency cap (the model's slo_p95_ms)
    offered: int
    offered_rps: float
    completed: int
    completed_rps: float
    attainment: float  # share of offered completed within the cap
    goodput_rps: float  # completed within the cap per second
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    mean_batch: float  # requests per executed batch
    mean_batch_cost: float  # cost units per executed batch
    batches: int
    ooms: int  # OOM splits over the whole run
    rejects: int
    timeouts: int
    errors: int
    unfinished: int
    oversize: int
    mem_peak_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class SimResult:
    arm: str
    duration_s: float
    warmup_s: float
    seed: int | None
    models: dict[str, ModelResult]
    series: dict[str, dict[str, list[float]]]  # model -> column -> values, one per control interval
    decisions: list[dict[str, Any]] = field(default_factory=list)  # changed decisions (broker arm)
    events: int = 0
    wall_s: float = 0.0

    def to_dict(self, series: bool = True) -> dict[str, Any]:
        out = {
            "arm": self.arm,
            "duration_s": self.duration_s,
            "warmup_s": self.warmup_s,
            "seed": self.seed,
            "models": {k: v.to_dict() for k, v in self.models.items()},
            "events": self.events,
            "wall_s": self.wall_s,
        }
        if series:
            out["series"] = self.series
            out["decisions"] = self.decisions
        return out
