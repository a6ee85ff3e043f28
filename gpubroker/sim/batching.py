"""How the simulator's emulated replicas form and run batches (a mixin of ``gpubroker.sim.engine.Simulator``).

- Eager formation is Ray 2.60's ``@serve.batch`` loop: the next batch starts forming as soon as a
  request is queued, takes every queued request that fits, closes at the cap or when its wait
  timer runs out, then waits for a ``max_concurrent_batches`` slot.
- Lazy formation (``--batching lazy``, static arms only) is BENCHMARK.md's quick model: a batch
  forms only when a slot is free, from everything queued by then.
- The broker arm's replicas run eager formation behind the replica's own ``LazyGate`` and run
  ``fast_loop_step`` before each batch (``deployments.units.gate``, ``deployments.units.fast_loop``).
- A batch over its replica's grant OOMs after ``a_ms`` of wasted card time and is split in two;
  a single request that cannot fit fails alone.
"""

from __future__ import annotations

import math

from deployments.units.fast_loop import fast_loop_step
from gpubroker.sim.types import DONE, EV_TIMER, FAILED, PENDING, TIMED_OUT, SimBatch, SimReplica


class BatchingMixin:
    """Batch formation, the fast loop and batch execution; state lives on ``Simulator``."""

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
        """The replica's own fast-loop step (``deployments.units.fast_loop``) on the emulated card's
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
