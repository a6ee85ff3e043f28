"""Discrete-event simulator: the real policy code on a virtual clock against emulated models.

A heap of timed events and the arrivals drive replicas that batch as Ray Serve's ``@serve.batch``
does (eager; lazy for static arms), run ``a + c*b + token_ms*tokens`` ms under processor sharing of
the card, OOM and split a batch over the grant, and reject or time out as the replica does.
``static:B[:WAIT_MS]`` arms are plain Serve; ``broker`` drives the live broker core (reports, ticks)
with the replica's own ``LazyGate`` and ``fast_loop_step``. Metrics cover arrivals in
``[warmup_s, duration_s)``; a request not done ``drain_s`` after the last arrival is a miss.
"""

from __future__ import annotations

import heapq
import math
import time as _time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gpubroker.broker.wire import ModelSettings
from gpubroker.deployments.replica.fast_loop import FastLoopParams, fast_loop_step, params_for
from gpubroker.deployments.replica.gate import LazyGate
from gpubroker.deployments.replica.shed import LateShed
from gpubroker.quotas.config import FleetConfig
from gpubroker.sim.broker import SimBroker
from gpubroker.sim.profile import profile_for
from gpubroker.sim.result import build_result
from gpubroker.sim.types import (
    BATCHING_MODES,
    DONE,
    EV_CONTROL,
    EV_GPU,
    EV_REPORT,
    EV_SAMPLE,
    EV_TIMER,
    FAILED,
    PENDING,
    REJECTED,
    START_EPOCH_S,
    TIMED_OUT,
    Arm,
    MemPool,
    SimBatch,
    SimReplica,
    SimResult,
    parse_arm,
)
from gpubroker.sim.workload import ModelArrivals

# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimOptions:
    """How one run is measured and what it keeps; the config, the arm and the workload apart."""

    warmup_s: float = 0.0  # arrivals before this are left out of the metrics
    drain_s: float = 5.0  # the run goes on this long after the arrivals end; what is not done is a miss
    seed: int | None = None  # recorded in the result (``run_sim`` draws the workload with it, 0 when None)
    batching: str = "eager"  # how plain @serve.batch forms batches: eager (Ray 2.60) or lazy
    start_epoch_s: float = START_EPOCH_S  # the epoch time of virtual time 0
    keep_decisions: int = 2000
    record: bool = False  # the broker arm keeps a trace of its calls (gpubroker.sim.broker)


class Simulator:
    """One run of one arm over one workload. ``run()`` once."""

    def __init__(
        self,
        config: FleetConfig,
        arm: Arm,
        workload: Mapping[str, ModelArrivals],
        duration_s: float,
        opts: SimOptions = SimOptions(),
    ):
        warmup_s, drain_s, batching = opts.warmup_s, opts.drain_s, opts.batching
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
        # (broker.batch_formation: lazy, the default): gpubroker.deployments.replica.gate.LazyGate, the same code.
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
        self.seed = opts.seed
        self.epoch0 = float(opts.start_epoch_s)
        self.capacity = int(capacity)
        self.usable = config.usable_bytes()
        self.keep_decisions = opts.keep_decisions
        self.names = list(config.models)
        self.profiles = {n: profile_for(n, s) for n, s in config.models.items()}
        missing = [n for n in workload if n not in config.models]
        if missing:
            raise ValueError(f"workload names models {missing} that the config lacks; add them under models:")
        self._take_requests(workload)
        self._make_replicas(workload)
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
        self.broker_options: dict[str, Any] = {}  # SimBroker's: a card of a many-card fleet (gpubroker.sim.broker)
        self.record = opts.record
        self.fast: dict[str, FastLoopParams] = {n: params_for(s, config) for n, s in config.models.items()}

    def _take_requests(self, workload: Mapping[str, ModelArrivals]) -> None:
        """Every model's requests, merged in time order (ties: model order), with their status."""
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

    def _make_replicas(self, workload: Mapping[str, ModelArrivals]) -> None:
        """Each model's emulated replicas, sharing one memory pool; their peaks and mean request cost."""
        config = self.config
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
        (``shed_late``, ``gpubroker.deployments.replica.shed``)."""
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

        assert rep.gate is not None  # lazy formation only
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

    # -- forming and running batches (module docstring: Batching, Memory) ----------------------

    def _cap(self, rep: SimReplica) -> int:
        return rep.max_batch if rep.local_cap is None else min(rep.max_batch, rep.local_cap)

    def _try_start(self, rep: SimReplica) -> None:
        """A slot is free: start a batch if it is full or its oldest request waited long enough."""
        q = rep.queue
        if not q:
            return
        if self.arr_t[q[0]] < self.now - rep.timeout_s:
            self._expire(rep)
            if not q:
                return
        cap = self._cap(rep)
        visible = (
            len(q)
            if rep.max_ongoing <= 0
            else min(len(q), max(1, rep.max_ongoing - sum(len(b.ids) for b in rep.running)))
        )
        if rep.prof.unit == "tokens":
            cost = self.cost
            full = False
            tot = 0
            for k in range(visible):
                tot += cost[q[k]]
                if tot >= cap:
                    full = True
                    break
        else:
            full = visible >= cap
        deadline = self.arr_t[q[0]] + rep.wait_s
        if full or self.now >= deadline - 1e-12:
            self._start_batch(rep, cap, visible)
            return
        if rep.timer_at != deadline:
            rep.timer_at = deadline
            rep.timer_ver += 1
            self._push(deadline, EV_TIMER, rep, rep.timer_ver)

    # -- eager formation (Ray 2.60's @serve.batch loop) -----------------------------------------

    def _form(self, rep: SimReplica) -> None:
        """Pull queued requests into the batch being formed, closing it when it is full or its
        timer has run out, and starting the next one (Ray's loop pulls the next request at once)."""
        q = rep.queue
        cap = self._cap(rep)
        tokens = rep.prof.unit == "tokens"
        cost = self.cost
        while True:
            if rep.forming is not None:
                if rep.form_cost >= cap:
                    self._close_forming(rep)
                    continue
                if q:  # Ray adds every queued request that fits, even after the timer ran out
                    nxt = cost[q[0]] if tokens else 1
                    if rep.form_cost + nxt > cap:
                        self._close_forming(rep)
                        continue
                    rep.forming.append(q.popleft())
                    rep.form_cost += nxt
                    continue
                if self.now >= rep.timer_at - 1e-12:
                    self._close_forming(rep)
                return
            if not q:
                return
            i = q.popleft()
            rep.forming = [i]
            rep.form_cost = cost[i] if tokens else 1
            rep.timer_at = self.now + rep.wait_s  # the timer starts when the first request is pulled
            rep.timer_ver += 1
            if rep.wait_s > 0:
                self._push(rep.timer_at, EV_TIMER, rep, rep.timer_ver)

    def _close_forming(self, rep: SimReplica) -> None:
        if rep.forming is None:
            return
        rep.formed.append(rep.forming)
        rep.forming = None
        rep.form_cost = 0
        rep.timer_at = math.inf
        rep.timer_ver += 1
        self._exec_formed(rep)

    def _exec_formed(self, rep: SimReplica) -> None:
        """Formed batches take free max_concurrent_batches slots in order."""
        limit = self.now - rep.timeout_s
        while rep.formed and len(rep.running) < rep.mcb:
            ids = rep.formed.popleft()
            live = []
            gate = rep.gate
            for i in ids:  # the replica answered these with 504 at their deadline; Serve drops them
                if gate is not None:
                    gate.settle(self._unit_cost(rep, i))  # out of the batcher's queue: run or dropped
                if self.arr_t[i] < limit:
                    self.status[i] = TIMED_OUT
                    rep.st_to += 1
                    rep.held -= 1
                else:
                    live.append(i)
            if not live:
                if gate is not None:
                    self._pump(rep)
                continue
            if self.broker is not None:
                self._fast_loop(rep)
            if gate is not None:
                gate.batch_started()
            b = SimBatch(rep, live, self.now)
            rep.running.append(b)
            self._run_chunk(b)
            self.batch_log.append((rep.m, self.now, len(live), float(sum(self.cost[i] for i in live)), 0))

    def _start_batch(self, rep: SimReplica, cap: int, visible: int) -> None:
        q = rep.queue
        rep.timer_at = math.inf
        rep.timer_ver += 1
        if self.broker is not None:
            self._fast_loop(rep)
            cap = self._cap(rep)
        oversize = 0
        if rep.prof.unit == "tokens":
            cost = self.cost
            ids = [q.popleft()]
            tot = cost[ids[0]]
            if tot > cap:
                oversize = 1
            else:
                while q and len(ids) < visible and tot + cost[q[0]] <= cap:
                    tot += cost[q[0]]
                    ids.append(q.popleft())
        else:
            k = min(cap, visible)
            ids = [q.popleft() for _ in range(k)]
        b = SimBatch(rep, ids, self.now)
        rep.running.append(b)
        self._run_chunk(b)
        self.batch_log.append((rep.m, self.now, len(ids), float(sum(self.cost[i] for i in ids)), oversize))

    def _fast_loop(self, rep: SimReplica) -> None:
        """The replica's own fast-loop step (``gpubroker.deployments.replica.fast_loop``) on the emulated card's
        free share (what a CUDA replica reads from NVML)."""
        used = self.mem_pool.total
        free = 1.0 - used / self.capacity
        cur = self._cap(rep)
        out = fast_loop_step(free, cur, rep.max_batch, rep.paused, self.fast[rep.name])
        if out.cap != cur:
            rep.local_cap = out.cap
            if rep.gate is not None:
                rep.gate.cap = out.cap
        rep.paused = out.paused
        if out.counted:
            rep.st_emerg += 1

    def _run_chunk(self, b: SimBatch) -> None:
        rep, prof = b.rep, b.rep.prof
        chunk = b.chunks.popleft()
        cost_units = sum(self.cost[i] for i in chunk)
        mem = prof.weights_bytes + prof.bytes_per_item * cost_units
        b.chunk_t0 = self.now
        if mem > rep.grant:
            if len(chunk) == 1:
                self.status[chunk[0]] = FAILED
                rep.st_err += 1
                rep.held -= 1
                b.ids = [i for i in b.ids if i != chunk[0]]
                if b.chunks:
                    self._run_chunk(b)
                else:
                    self._finish_batch(b)
                return
            half = len(chunk) // 2
            b.chunks.appendleft(chunk[half:])
            b.chunks.appendleft(chunk[:half])
            rep.st_oom += 1
            rep.st_oom_costs.append(float(cost_units))  # what the replica reports: the cost that ran out
            self.oom_total[rep.m] += 1
            b.chunk = None
            b.chunk_cost = 0
            work = prof.a_ms  # time lost until the allocator gives up
            mem = min(mem, rep.grant)
        else:
            b.chunk = chunk
            b.chunk_cost = cost_units
            work = prof.latency_ms(cost_units, sum(self.tok[i] for i in chunk) if prof.token_ms else 0)
        b.mem = mem - prof.weights_bytes
        rep.mem_now = prof.weights_bytes + sum(x.mem for x in rep.running)
        if rep.mem_now > rep.st_peak:
            rep.st_peak = rep.mem_now
        if rep.mem_now > self.peak[rep.m]:
            self.peak[rep.m] = rep.mem_now
        self._gpu_add(b, work)

    def _chunk_done(self, b: SimBatch) -> None:
        rep = b.rep
        if b.chunk is not None:
            rep.st_batches.append((float(b.chunk_cost), (self.now - b.chunk_t0) * 1000.0))
            rep.st_breq.append(len(b.chunk))
        if b.chunks:
            self._run_chunk(b)
            return
        self._finish_batch(b)

    def _finish_batch(self, b: SimBatch) -> None:
        rep = b.rep
        rep.running.remove(b)
        b.mem = 0.0
        rep.mem_now = rep.prof.weights_bytes + sum(x.mem for x in rep.running)
        now = self.now
        arr_t = self.arr_t
        done_t, status = self.done_t, self.status
        lat = rep.st_lat
        for i in b.ids:
            if status[i] == PENDING:
                status[i] = DONE
                done_t[i] = now
                lat.append((now - arr_t[i]) * 1000.0)
        rep.st_done += len(b.ids)
        rep.held -= len(b.ids)
        if rep.shed is not None:
            rep.shed.batch_ran(now - b.start_t)
        if rep.gate is not None:
            rep.gate.batch_ended()
            self._exec_formed(rep)
            self._pump(rep)
        elif self.eager:
            self._exec_formed(rep)
        elif rep.queue:
            self._try_start(rep)

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
        assert self.broker is not None  # the broker arm's events only
        s = self.broker.report(rep)
        if s.version != rep.version:
            self._apply(rep, s)

    def _control(self) -> None:
        self._gpu_advance()
        assert self.broker is not None
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
            self.broker = SimBroker(self, record=self.record, **self.broker_options)
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
    opts: SimOptions = SimOptions(),
    *,
    arrivals: str = "poisson",
    workload: Mapping[str, ModelArrivals] | None = None,
) -> SimResult:
    """Draw the workload (unless given) with ``opts.seed`` (0 when None) and run one arm: the
    one-call entry point."""
    from gpubroker.sim.workload import make_workload  # noqa: PLC0415

    arm = parse_arm(policy) if isinstance(policy, str) else policy
    seed = 0 if opts.seed is None else opts.seed
    opts = replace(opts, seed=seed)
    if workload is None:
        profiles = {n: profile_for(n, s) for n, s in config.models.items()}
        workload = make_workload(profiles, rates, duration_s, arrivals, seed)
    return Simulator(config, arm, workload, duration_s, opts).run()
