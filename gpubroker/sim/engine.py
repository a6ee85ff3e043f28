"""Discrete-event simulator: the real policy code on a virtual clock against emulated models.

Design notes (what is emulated, and how):

- **Clock.** A heap of timed events (batch timers, batch completions, reports, control
  ticks, samples) plus the pre-generated arrivals merged in time order. Virtual time runs
  from 0; snapshots and reports carry ``start_epoch_s + t`` as their epoch time.
- **Batching** mimics Ray Serve's ``@serve.batch`` with ``max_concurrent_batches`` slots
  per replica (1 by default): when a slot is free, a batch starts as soon as
  ``max_batch_size`` cost units are queued or ``batch_wait_timeout_s`` has passed since the
  oldest queued request arrived. It takes queued requests in order while their summed cost
  stays within ``max_batch_size`` (token models count tokens, like ``batch_size_fn``); a
  single request costlier than the cap runs alone and is counted as ``oversize``. When
  ``max_ongoing_requests`` is set (> 0) the replica sees only that many requests at once,
  as Serve's router holds the rest back.
- **Latency.** A batch of cost b (requests, or tokens for token models) holding ``tokens``
  tokens needs ``a + c·b + token_ms·tokens`` ms of the card, as the ``profiled`` adapter
  sleeps (see ``gpubroker.sim.profile``).
- **GPU sharing: processor sharing.** When k batches (of any models) execute at once on the
  card, each progresses at 1/k speed; a batch's wall time therefore grows with the
  neighbours' load, and the replica reports that wall time (as a real one would).
- **Memory.** A batch needs ``weights + bytes_per_item·cost``; if that exceeds the
  replica's grant (the model's grant split evenly over its replicas) the batch OOMs after
  ``a_ms`` of wasted card time, is split in two, and each half is retried in turn, as the
  replica does (``oom_splits`` counts the splits). A single request that cannot fit fails
  (counted in ``errors``). All requests of a batch complete together when its last half ends.
- **Admission.** An arrival finding ``max_queued`` requests waiting at its replica, or
  admission paused, is rejected; a request waiting longer than ``request_timeout_s`` times
  out when the replica next looks at its queue. Replicas of one model are picked by
  shortest queue.
- **Arms.** ``static:B[:WAIT_MS]`` is plain Serve: batch cap B (token models: B × the mean
  request length in tokens), wait WAIT_MS (default 10), grant = ``quota.base``, no broker.
  ``broker`` runs the live broker core (``gpubroker.sim.broker``): each replica registers with its
  calibration, sends one ``StatsReport`` delta every ``report_interval_s`` through
  ``BrokerCore.report`` and applies the settings in the reply when their version changes; every
  ``control_interval_s`` the simulator calls ``BrokerCore.tick``. Its replicas run the
  replica's own ``LazyGate`` in front of the eager batcher (``broker.batch_formation: lazy``) and
  the replica's ``fast_loop_step`` before each batch, on the emulated card's free share: halve
  under ``gpu.emergency_free_frac``, pause admission when still critical at the floor, widen
  back when headroom returns. ``max_ongoing_requests`` is the deployment's
  (``ModelSpec.max_ongoing_requests``).
- **Run end.** Arrivals come in ``[0, duration_s)``; the run goes on for ``drain_s`` more;
  requests not done by then count as ``unfinished`` (misses). Metrics cover requests that
  arrived in ``[warmup_s, duration_s)``.
"""

from __future__ import annotations

import heapq
import math
import time as _time
from collections.abc import Mapping
from typing import Any

import numpy as np

from broker.wire import ModelSettings
from deployments.units.fast_loop import FastLoopParams, params_for
from deployments.units.gate import LazyGate
from deployments.units.shed import LateShed
from gpubroker.sim.batching import BatchingMixin
from gpubroker.sim.broker import SimBroker
from gpubroker.sim.profile import profile_for
from gpubroker.sim.result import build_result
from gpubroker.sim.types import (  # noqa: F401 - re-exported: gpubroker.sim.engine is the simulator's public face
    BATCHING_MODES,
    DONE,
    EV_CONTROL,
    EV_GPU,
    EV_REPORT,
    EV_SAMPLE,
    EV_TIMER,
    FAILED,
    LATENCY_SAMPLES_PER_REPORT,
    PENDING,
    POLICY_FORMS,
    REJECTED,
    START_EPOCH_S,
    TIMED_OUT,
    Arm,
    MemPool,
    ModelResult,
    SimBatch,
    SimReplica,
    SimResult,
    parse_arm,
)
from gpubroker.sim.workload import ModelArrivals
from quotas.config import FleetConfig

# ---------------------------------------------------------------------------------------------


class Simulator(BatchingMixin):
    """One run of one arm over one workload. ``run()`` once."""

    def __init__(
        self,
        config: FleetConfig,
        arm: Arm,
        workload: Mapping[str, ModelArrivals],
        duration_s: float,
        *,
        warmup_s: float = 0.0,
        drain_s: float = 5.0,
        seed: int | None = None,
        start_epoch_s: float = START_EPOCH_S,
        keep_decisions: int = 2000,
        batching: str = "eager",
        record: bool = False,
    ):
        capacity = config.gpu.capacity_bytes
        if capacity is None:
            raise ValueError(
                "gpu.capacity is 'auto'; the simulator has no card to measure. Set gpu.capacity to an explicit size "
                "in the config (e.g. capacity: 80GiB)"
            )
        if not 0 <= warmup_s < duration_s:
            raise ValueError(f"warmup_s ({warmup_s}) must be in [0, duration_s {duration_s})")
        if batching not in BATCHING_MODES:
            raise ValueError(f"batching '{batching}' is not known; use {' or '.join(BATCHING_MODES)}")
        # ``batching`` is how plain @serve.batch forms batches (what static arms get). The broker's
        # replicas run Ray's eager batcher behind the replica's own lazy gate
        # (broker.batch_formation: lazy, the default): deployments.units.gate.LazyGate, the same code.
        # A static arm gets the same gate when it asks for it (``static:B:W:gate``, the ablation).
        self.gated = (arm.kind == "broker" and config.broker.batch_formation == "lazy") or arm.gated
        if arm.kind == "broker" or arm.gated:
            batching = "eager"
        self.eager = batching == "eager"
        self.config = config
        self.arm = arm
        self.duration_s = float(duration_s)
        self.warmup_s = float(warmup_s)
        self.end_t = float(duration_s) + float(drain_s)
        self.seed = seed
        self.epoch0 = float(start_epoch_s)
        self.capacity = int(capacity)
        self.usable = config.usable_bytes()
        self.keep_decisions = keep_decisions
        self.names = list(config.models)
        self.profiles = {n: profile_for(n, s) for n, s in config.models.items()}
        missing = [n for n in workload if n not in config.models]
        if missing:
            raise ValueError(f"workload names models {missing} that the config lacks; add them under models:")

        # Requests, merged over models in time order (ties: model order).
        times, mids, costs, toks = [], [], [], []
        for m, name in enumerate(self.names):
            w = workload.get(name)
            if w is None or len(w.times) == 0:
                continue
            times.append(np.asarray(w.times, dtype=np.float64))
            mids.append(np.full(len(w.times), m, dtype=np.int64))
            costs.append(np.asarray(w.costs, dtype=np.int64))
            toks.append(np.asarray(w.tokens, dtype=np.int64))
        if times:
            t_all = np.concatenate(times)
            m_all = np.concatenate(mids)
            c_all = np.concatenate(costs)
            k_all = np.concatenate(toks)
            order = np.lexsort((m_all, t_all))
            t_all, m_all, c_all, k_all = t_all[order], m_all[order], c_all[order], k_all[order]
        else:
            t_all = np.zeros(0)
            m_all = np.zeros(0, dtype=np.int64)
            c_all = np.zeros(0, dtype=np.int64)
            k_all = np.zeros(0, dtype=np.int64)
        self.t_np, self.m_np, self.c_np = t_all, m_all, c_all
        self.arr_t: list[float] = t_all.tolist()
        self.arr_m: list[int] = m_all.tolist()
        self.cost: list[int] = c_all.tolist()
        self.tok: list[int] = k_all.tolist()
        n = len(self.arr_t)
        self.done_t = np.full(n, np.nan)
        self.status = np.zeros(n, dtype=np.int8)
        self.batch_log: list[tuple[int, float, int, float, int]] = []  # (model, start_t, n, cost, oversize)

        # Replicas.
        self.mem_pool = MemPool()  # what they hold now, all together
        self.replicas: list[list[SimReplica]] = []
        for m, name in enumerate(self.names):
            spec = config.models[name]
            self.replicas.append(
                [
                    SimReplica(m, name, f"{name}#{r}", self.profiles[name], spec, self.mem_pool)
                    for r in range(spec.replicas)
                ]
            )
        self.all_reps = [r for reps in self.replicas for r in reps]
        self.oom_total = [0] * len(self.names)
        self.peak = [float(self.profiles[n].weights_bytes) for n in self.names]
        self.mean_cost = {
            name: (
                float(workload[name].costs.mean())
                if name in workload and len(workload[name].costs)
                else (self.profiles[name].mean_tokens if self.profiles[name].unit == "tokens" else 1.0)
            )
            for name in self.names
        }

        # Card (processor sharing).
        self.gpu_jobs: dict[SimBatch, float] = {}  # batch -> remaining solo work, ms
        self.gpu_t = 0.0
        self.gpu_ver = 0
        self.card_busy = 0.0  # seconds with >= 1 batch executing
        self._in_gpu_event = False

        self.heap: list[tuple[float, int, int, Any, int]] = []
        self._seq = 0
        self.now = 0.0
        self.events = 0

        # Series.
        self.series: dict[str, dict[str, list[float]]] = {
            name: {k: [] for k in ("t", "max_batch", "wait_ms", "grant_bytes", "queue", "mem_bytes")}
            for name in self.names
        }
        self.decisions: list[dict[str, Any]] = []
        self.broker: SimBroker | None = None
        self.record = record
        self.fast: dict[str, FastLoopParams] = {n: params_for(s, config) for n, s in config.models.items()}

    # -- event plumbing ------------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj: Any = None, ver: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, kind, self._seq, obj, ver))

    # -- settings ------------------------------------------------------------------------------

    def _apply(self, rep: SimReplica, s: ModelSettings) -> None:
        spec = self.config.models[rep.name]
        reps = spec.replicas
        rep.max_batch = max(1, int(s.max_batch_size))
        rep.wait_s = max(0.0, float(s.batch_wait_timeout_s))
        rep.grant = float(s.grant_bytes) / reps if s.grant_bytes and s.grant_bytes > 0 else math.inf
        rep.admit = bool(s.admit)
        if s.admit:
            rep.paused = False  # as the replica does: the broker re-opened admission
        rep.version = int(s.version)
        rep.local_cap = None
        if rep.gate is not None:
            rep.gate.cap = rep.max_batch
            rep.gate.wait_s = rep.wait_s
        if self.eager:
            self._form(rep)
        elif rep.queue and len(rep.running) < rep.mcb:
            self._try_start(rep)

    def _static_settings(self, name: str) -> ModelSettings:
        spec = self.config.models[name]
        b = self.arm.batch
        if self.profiles[name].unit == "tokens":
            b = max(1, int(round(b * self.mean_cost[name])))
        return ModelSettings(
            model=name,
            version=0,
            max_batch_size=b,
            batch_wait_timeout_s=self.arm.wait_ms / 1000.0,
            grant_bytes=int(spec.quota.base),
            admit=True,
        )

    # -- arrivals and batching -----------------------------------------------------------------

    def held_requests(self, rep: SimReplica) -> int:
        """Requests the replica holds (its ``waiting``): at the gate, queued, forming, formed, running."""
        return rep.held  # counted in on admission, out when answered (done, timed out, failed)

    def _arrive(self, i: int) -> None:
        reps = self.replicas[self.arr_m[i]]
        rep = reps[0] if len(reps) == 1 else min(reps, key=lambda r: len(r.queue) + len(r.running))
        # the replica counts every request it holds: at the gate, queued, forming, formed, running
        waiting = self.held_requests(rep) if self.eager else len(rep.queue)
        if not rep.admit or rep.paused or waiting >= rep.max_queued:
            self.status[i] = REJECTED
            rep.st_rej += 1
            return
        rep.st_arr += 1
        rep.held += 1
        if rep.gate is not None and not rep.gate.admit(i, self._unit_cost(rep, i)):
            return  # held at the gate until a batch ends
        rep.queue.append(i)
        if self.eager:
            self._form(rep)
        elif len(rep.running) < rep.mcb:
            self._try_start(rep)

    def _unit_cost(self, rep: SimReplica, i: int) -> int:
        return self.cost[i] if rep.prof.unit == "tokens" else 1

    def _pump(self, rep: SimReplica) -> None:
        """The slot freed: the gate lets up to one cap in; requests that timed out while held
        were answered 504 by the replica and are dropped, as are those too late for the SLO
        (``shed_late``, ``deployments.units.shed``)."""
        now = self.now
        limit = now - rep.timeout_s
        arr_t, status, shed = self.arr_t, self.status, rep.shed

        def alive(i: int) -> bool:
            if arr_t[i] < limit:
                status[i] = TIMED_OUT
                rep.st_to += 1
                rep.held -= 1
                return False
            if shed is not None and shed.too_late(now - arr_t[i]):
                status[i] = TIMED_OUT
                rep.st_to += 1
                rep.st_shed += 1
                rep.held -= 1
                return False
            return True

        released = rep.gate.pump(alive)
        if released:
            rep.queue.extend(released)
            self._form(rep)
            self._released(rep)

    def _released(self, rep: SimReplica) -> None:
        """After the gate let requests in and a batch formed from them: a hook for variants
        (``bench.lending_gap``); the simulator itself does nothing more here."""

    def _expire(self, rep: SimReplica) -> None:
        q = rep.queue
        limit = self.now - rep.timeout_s
        arr_t = self.arr_t
        while q and arr_t[q[0]] < limit:
            i = q.popleft()
            self.status[i] = TIMED_OUT
            rep.st_to += 1
            rep.held -= 1

    # -- the card ------------------------------------------------------------------------------

    def _gpu_advance(self) -> None:
        dt = self.now - self.gpu_t
        jobs = self.gpu_jobs
        if dt > 0 and jobs:
            k = len(jobs)
            step = dt * 1000.0 / k
            for j in jobs:
                jobs[j] -= step
            self.card_busy += dt
            for r in {j.rep for j in jobs}:  # each replica with a batch on the card, once
                r.busy_acc += dt
        self.gpu_t = self.now

    def _gpu_add(self, b: SimBatch, work_ms: float) -> None:
        self._gpu_advance()
        self.gpu_jobs[b] = work_ms
        if not self._in_gpu_event:
            self._gpu_schedule()

    def _gpu_schedule(self) -> None:
        self.gpu_ver += 1
        if self.gpu_jobs:
            rem = min(self.gpu_jobs.values())
            self._push(self.now + max(0.0, rem) * len(self.gpu_jobs) / 1000.0, EV_GPU, None, self.gpu_ver)

    def _gpu_event(self) -> None:
        self._gpu_advance()
        finished = [j for j, rem in self.gpu_jobs.items() if rem <= 1e-7]
        if not finished:  # float drift: take the smallest
            j = min(self.gpu_jobs, key=self.gpu_jobs.__getitem__)
            finished = [j]
        self._in_gpu_event = True
        for j in finished:
            del self.gpu_jobs[j]
        for j in finished:
            self._chunk_done(j)
        self._in_gpu_event = False
        self._gpu_schedule()

    # -- broker --------------------------------------------------------------------------------

    def _report(self, rep: SimReplica) -> None:
        s = self.broker.report(rep)
        if s.version != rep.version:
            self._apply(rep, s)

    def _control(self) -> None:
        self._gpu_advance()
        self.broker.tick()

    def _sample(self) -> None:
        for m, name in enumerate(self.names):
            reps = self.replicas[m]
            col = self.series[name]
            col["t"].append(round(self.now, 6))
            col["max_batch"].append(float(reps[0].max_batch if reps[0].local_cap is None else self._cap(reps[0])))
            col["wait_ms"].append(reps[0].wait_s * 1000.0)
            g = sum(r.grant for r in reps)
            col["grant_bytes"].append(float(g) if math.isfinite(g) else -1.0)
            col["queue"].append(float(sum(len(r.queue) for r in reps)))
            col["mem_bytes"].append(float(sum(r.mem_now for r in reps)))

    # -- run -----------------------------------------------------------------------------------

    def run(self) -> SimResult:
        wall0 = _time.perf_counter()
        ctrl = self.config.broker.control_interval_s
        if self.arm.kind == "broker":
            self.broker = SimBroker(self, record=self.record)
            rep_iv = self.config.broker.report_interval_s
            n = len(self.all_reps)
            for k, rep in enumerate(self.all_reps):
                spec = self.config.models[rep.name]
                rep.max_ongoing = spec.max_ongoing_requests  # as the fleet deploys it
                if self.gated and spec.control.strategy != "static":
                    rep.gate = LazyGate(max_concurrent_batches=rep.mcb, clock=lambda: self.now)
                    rep.shed = LateShed(spec.slo_p95_ms / 1000.0) if spec.shed_late else None
                self._apply(rep, self.broker.register(rep))
                self._push(rep_iv * (k + 1) / n, EV_REPORT, rep)
            self._push(ctrl, EV_CONTROL)
        else:
            for rep in self.all_reps:
                if self.gated:
                    spec = self.config.models[rep.name]
                    rep.gate = LazyGate(max_concurrent_batches=rep.mcb, clock=lambda: self.now)
                    rep.shed = LateShed(spec.slo_p95_ms / 1000.0) if spec.shed_late else None
                self._apply(rep, self._static_settings(rep.name))
        self._sample()
        self._push(ctrl, EV_SAMPLE)

        heap = self.heap
        arr_t = self.arr_t
        n = len(arr_t)
        i = 0
        end_t = self.end_t
        events = 0
        pop = heapq.heappop
        while True:
            next_t = heap[0][0] if heap else math.inf
            if i < n and arr_t[i] <= next_t:
                self.now = arr_t[i]
                self._arrive(i)
                i += 1
                events += 1
                continue
            if next_t > end_t:
                break
            t, kind, _, obj, ver = pop(heap)
            self.now = t
            events += 1
            if kind == EV_GPU:
                if ver == self.gpu_ver:
                    self._gpu_event()
            elif kind == EV_TIMER:
                if ver == obj.timer_ver:
                    obj.timer_at = math.inf
                    if self.eager:
                        self._close_forming(obj)
                        self._form(obj)
                    elif len(obj.running) < obj.mcb:
                        self._try_start(obj)
            elif kind == EV_REPORT:
                self._report(obj)
                self._push(t + self.config.broker.report_interval_s, EV_REPORT, obj)
            elif kind == EV_CONTROL:
                self._control()
                self._push(t + ctrl, EV_CONTROL)
            elif kind == EV_SAMPLE:
                self._sample()
                self._push(t + ctrl, EV_SAMPLE)
        self.now = end_t
        self.events = events
        result = build_result(self)
        result.wall_s = _time.perf_counter() - wall0
        return result

    # -- results -------------------------------------------------------------------------------


def run_sim(
    config: FleetConfig,
    policy: str | Arm,
    rates: Mapping[str, float],
    duration_s: float,
    *,
    arrivals: str = "poisson",
    seed: int = 0,
    warmup_s: float = 0.0,
    drain_s: float = 5.0,
    workload: Mapping[str, ModelArrivals] | None = None,
    batching: str = "eager",
) -> SimResult:
    """Draw the workload (unless given) and run one arm: the one-call entry point."""
    from gpubroker.sim.workload import make_workload  # noqa: PLC0415

    arm = parse_arm(policy) if isinstance(policy, str) else policy
    if workload is None:
        profiles = {n: profile_for(n, s) for n, s in config.models.items()}
        workload = make_workload(profiles, rates, duration_s, arrivals, seed)
    sim = Simulator(config, arm, workload, duration_s, warmup_s=warmup_s, drain_s=drain_s, seed=seed, batching=batching)
    return sim.run()
