"""An adaptive per-model batcher at the fixed split, after BentoML's ``CorkDispatcher``.

The simulator's arm for ``bench.matrix``: each model keeps its base (the fixed split) and its
largest batch that fits it, and a dispatcher decides when to close a batch, as BentoML's
``bentoml/_internal/marshal/dispatcher.py`` (``CorkDispatcher.controller``'s main loop and its
``Optimizer``) does:

- the optimizer fits the batch duration ``o_a x n + o_b`` by least squares over the last 50
  batches (the first 2 skipped), refreshed at most every 5 s after two immediate refreshes (its
  token bucket), and keeps ``wait``, the mean time the last-taken request of a batch waited;
  before a fit, ``o_a = min(2, 2 max_latency / 30)``, ``o_b = min(1, max_latency / 30)``, ``wait = 0.01`` s;
- with n queued, the oldest waiting w0 and the newest wn: while ``n > 1`` and
  ``w0 + o_a n + o_b >= max_latency`` the oldest is cancelled (a miss; alone in the queue it is
  cancelled once ``w0 >= max_latency``, while a batch runs); with a free slot it waits while
  ``n < max_batch_size`` and ``n (wn + tick + o_a) <= 0.95 wait``, else dispatches, taking the
  newest requests first (``deque.pop``), one batch at a time (its semaphore of 1);
- ``max_latency`` is the model's SLO (the cap both arms are held to); the cancel is its shedding.

Left out: the warm-up stages (its first six batches of 1, 1, 2 and 3 requests), and its
batch-size-aware fill, which takes one request under ``max_batch_size``: here a batch takes up
to ``max_batch_size``, the batch the base holds, as the fixed batch does. The 1 ms tick is
replaced by a timer at the moment the wait or cancel condition flips.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from bench.matrix_static import PerModelStatic
from gpubroker.sim.types import EV_TIMER, TIMED_OUT, SimBatch, SimReplica

TICK_S = 0.001
DECAY = 0.95
N_KEPT, N_SKIPPED, REFRESH_S = 50, 2, 5.0


@dataclass
class Cork:
    """One replica's dispatcher state (BentoML's ``Optimizer`` and its token bucket)."""

    max_latency: float
    o_a: float = 0.0
    o_b: float = 0.0
    wait: float = 0.01
    stats: deque[tuple[int, float, float]] = field(default_factory=lambda: deque(maxlen=N_KEPT))
    counter: int = 0
    tokens: float = 2.0
    token_t: float = 0.0

    def __post_init__(self) -> None:
        self.o_a = min(2.0, self.max_latency * 2.0 / 30)
        self.o_b = min(1.0, self.max_latency / 30)

    def log(self, n: int, wait: float, duration: float, now: float) -> None:
        if self.counter <= N_SKIPPED + 4:
            self.counter += 1
            if self.counter <= N_SKIPPED:
                return
        self.stats.append((n, duration, wait))
        tokens = min(1.0, self.tokens + (now - self.token_t) / REFRESH_S)
        if tokens >= 1.0:
            self.tokens, self.token_t = tokens - 1.0, now
            self.refresh()

    def refresh(self) -> None:
        x = np.array([(n, 1.0) for n, _d, _w in self.stats])
        y = np.array([d for _n, d, _w in self.stats])
        o_a, o_b = np.linalg.lstsq(x, y, rcond=None)[0]
        self.o_a, self.o_b = max(1e-6, float(o_a)), max(0.0, float(o_b))
        self.wait = max(0.0, float(np.mean([w for _n, _d, w in self.stats])))


class CorkSim(PerModelStatic):
    """The static arm at each model's base batch, batches closed by ``Cork`` (module docstring)."""

    def cork(self, rep: SimReplica) -> Cork:
        corks = self.__dict__.setdefault("_corks", {})
        if rep.rid not in corks:
            corks[rep.rid] = Cork(self.config.models[rep.name].slo_p95_ms / 1000.0)
        return corks[rep.rid]

    def _cancel_oldest(self, rep: SimReplica) -> None:
        i = rep.queue.popleft()
        self.status[i] = TIMED_OUT
        rep.st_to += 1
        rep.held -= 1

    def _try_start(self, rep: SimReplica) -> None:
        c, q, now, arr = self.cork(rep), rep.queue, self.now, self.arr_t
        while q:
            n, w0, wn = len(q), now - arr[q[0]], now - arr[q[-1]]
            if n > 1 and w0 + c.o_a * n + c.o_b >= c.max_latency:
                self._cancel_oldest(rep)
                continue
            if len(rep.running) >= rep.mcb:
                if n == 1 and w0 >= c.max_latency:
                    self._cancel_oldest(rep)
                return
            cap = rep.max_batch
            if n < cap and n * (wn + TICK_S + c.o_a) <= c.wait * DECAY:
                flip = c.wait * DECAY / n - TICK_S - c.o_a - wn  # the wait condition's last moment
                if n > 1:
                    flip = min(flip, c.max_latency - c.o_a * n - c.o_b - w0)
                self._timer(rep, now + max(TICK_S, flip + 1e-9))
                return
            ids = [q.pop() for _ in range(min(n, cap))]  # the newest first, as deque.pop does
            self._launch(rep, ids)
            return

    def _timer(self, rep: SimReplica, at: float) -> None:
        if rep.timer_at == at or not math.isfinite(at):
            return
        rep.timer_at = at
        rep.timer_ver += 1
        self._push(at, EV_TIMER, rep, rep.timer_ver)

    def _launch(self, rep: SimReplica, ids: list[int]) -> None:
        rep.timer_at = math.inf
        rep.timer_ver += 1
        b = SimBatch(rep, ids, self.now)
        rep.running.append(b)
        self._run_chunk(b)
        self.batch_log.append((rep.m, self.now, len(ids), float(len(ids)), 0))

    def _finish_batch(self, b: SimBatch) -> None:
        if b.ids:
            self.cork(b.rep).log(len(b.ids), b.start_t - self.arr_t[b.ids[-1]], self.now - b.start_t, self.now)
        super()._finish_batch(b)
