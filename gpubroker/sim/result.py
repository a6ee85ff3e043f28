"""The simulator's results: per-model metrics over requests that arrived in [warmup_s, duration_s)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpubroker.sim.types import DONE, FAILED, PENDING, REJECTED, TIMED_OUT, ModelResult, SimResult


def build_result(self: Any) -> SimResult:
    """``self``: the ``gpubroker.sim.engine.Simulator`` that ran (typed loosely: this module must not import it)."""
    t, mids, st = self.t_np, self.m_np, self.status
    lat_ms = (self.done_t - t) * 1000.0
    in_win = (t >= self.warmup_s) & (t < self.duration_s)
    span = self.duration_s - self.warmup_s
    blog = np.array(self.batch_log, dtype=np.float64).reshape(-1, 5)
    out: dict[str, ModelResult] = {}
    for m, name in enumerate(self.names):
        spec = self.config.models[name]
        cap = float(spec.slo_p95_ms)
        sel = in_win & (mids == m)
        offered = int(sel.sum())
        s = st[sel]
        done = s == DONE
        lat = lat_ms[sel][done]
        completed = int(done.sum())
        good = int((lat <= cap).sum())
        p50: float | None = None
        p95: float | None = None
        p99: float | None = None
        if completed:
            p50, p95, p99 = (float(x) for x in np.percentile(lat, [50, 95, 99]))
        bsel = (blog[:, 0] == m) & (blog[:, 1] >= self.warmup_s) & (blog[:, 1] < self.duration_s)
        nb = int(bsel.sum())
        out[name] = ModelResult(
            model=name,
            cap_ms=cap,
            offered=offered,
            offered_rps=offered / span,
            completed=completed,
            completed_rps=completed / span,
            attainment=good / offered if offered else 1.0,
            goodput_rps=good / span,
            p50_ms=p50,
            p95_ms=p95,
            p99_ms=p99,
            mean_batch=float(blog[bsel, 2].mean()) if nb else 0.0,
            mean_batch_cost=float(blog[bsel, 3].mean()) if nb else 0.0,
            batches=nb,
            ooms=self.oom_total[m],
            rejects=int((s == REJECTED).sum()),
            timeouts=int((s == TIMED_OUT).sum()),
            errors=int((s == FAILED).sum()),
            unfinished=int((s == PENDING).sum()),
            oversize=int(blog[bsel, 4].sum()) if nb else 0,
            mem_peak_bytes=int(self.peak[m]),
        )
    return SimResult(
        arm=self.arm.label,
        duration_s=self.duration_s,
        warmup_s=self.warmup_s,
        seed=self.seed,
        models=out,
        series=self.series,
        decisions=self.decisions,
        events=self.events,
    )
