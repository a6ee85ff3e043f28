"""Open-loop HTTP load generator and the per-arm summary (BENCHMARK.md, "Load" and "Metrics").

- **Open loop.** Every arrival time is fixed before the run (``gpubroker.sim.arrivals``); a single
  dispatcher sleeps until each one and fires the request as its own task, never waiting for
  a response before sending the next. One ``aiohttp`` session, connection limit
  ``conn_limit`` (0 = unlimited), bodies encoded before the run.
- **One record per request**: scheduled offset, actual send, finish, HTTP status (0 =
  client-side timeout or connection error), model, latency. Latency is counted from the
  *scheduled* send time, so a client that falls behind cannot hide queueing
  (no coordinated omission); the send lag is reported beside it.
- **Summary** (``summarize``): requests scheduled in ``[warmup_s, duration_s − cooldown_s)``
  count; offered and completed rate, attainment (share of offered that finished 200 within
  the cap: drops, rejections and timeouts are misses), goodput, nearest-rank P50/P95/P99 of
  the completed, rejections (503), timeouts (504 or client), errors, and ``passes``
  (attainment ≥ 0.99, a late answer a miss: the knee criterion of ``gpubroker.sim.knee``).
- Optionally polls ``GET /v1/status`` every ``status_every_s`` during the run, for mean
  batch sizes, batch caps and quota over time.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gpubroker.sim import arrivals as arr

ATTAINMENT_MIN = 0.99  # answered within the cap / offered at a passing rate (BENCHMARK.md; a late answer is a miss)
STATUS_OK = 200
STATUS_CLIENT_FAIL = 0  # client-side timeout or connection error


@dataclass(frozen=True)
class Planned:
    """One request of a schedule: when (seconds from the run start), to which model, what."""

    t_s: float
    model: str
    body: bytes
    tokens: int = 1


@dataclass
class Record:
    """What happened to one planned request."""

    idx: int
    model: str
    sched_s: float  # planned send offset from the run start
    send_s: float | None = None  # actual send offset (None: never sent)
    finish_s: float | None = None  # offset when the response (or the failure) came
    status: int = -1  # HTTP status; 0 client timeout/connection error; -1 never sent
    latency_ms: float | None = None  # finish − scheduled send
    server_ms: float | None = None  # the ingress' own latency_ms, when it answered 200
    tokens: int = 1
    error: str | None = None
    batch: int | None = None  # requests in the batch it ran in (bench.tagged models)
    batch_cost: int | None = None  # that batch's cost (requests or tokens)
    batch_ms: float | None = None  # that batch's predict time
    stamps: dict[str, float] | None = None  # bench.tagged wall-clock stamps: _t_val, _t0, _t1 (time.time())


@dataclass
class RunResult:
    records: list[Record]
    duration_s: float  # the schedule's length (arrivals in [0, duration_s))
    wall_s: float  # from the first send until the last response
    status_samples: list[dict[str, Any]] = field(default_factory=list)  # (t_s, status) polls
    t0_wall: float = 0.0  # time.time() at the run's start (offset 0 of send_s / finish_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "duration_s": self.duration_s,
            "wall_s": self.wall_s,
            "records": [asdict(r) for r in self.records],
            "status_samples": self.status_samples,
        }


# ------------------------------------------------------------------------------ schedules
def default_body(model_kind: str, tokens: int = 1) -> bytes:
    """A one-item request body ``{"inputs": [item]}`` (the fleet ingress, the plain baseline and
    the BentoML peer all take it): ``profiled`` gets its token count, ``minilm`` a text."""
    if model_kind == "minilm":
        words = max(1, tokens - 2)  # ~1 token per short word, plus [CLS]/[SEP]
        item: dict[str, Any] = {"text": " ".join(("word",) * words)}
    elif tokens > 1:
        item = {"tokens": int(tokens)}
    else:
        item = {}
    return json.dumps({"inputs": [item]}).encode()


def plan(
    model: str,
    times: Sequence[float] | np.ndarray,
    body: bytes | Callable[[int], bytes] = b'{"inputs": [{}]}',
    tokens: Sequence[int] | np.ndarray | None = None,
) -> list[Planned]:
    """A schedule for one model: one ``Planned`` per arrival time (``body(tokens)`` when callable)."""
    out = []
    for i, t in enumerate(times):
        tok = int(tokens[i]) if tokens is not None else 1
        b = body(tok) if callable(body) else body
        out.append(Planned(float(t), model, b, tok))
    return out


def merge(*schedules: Iterable[Planned]) -> list[Planned]:
    """Several models' schedules as one, in time order."""
    allp = [p for s in schedules for p in s]
    allp.sort(key=lambda p: p.t_s)
    return allp


def schedule_for(
    kind: str, rate: float, duration_s: float, seed: int, *, cv: float = 1.0, trace_path: str | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Arrival times (and token lengths for the trace) of one model: poisson | gamma | trace."""
    if kind == "poisson":
        return arr.poisson(rate, duration_s, seed), None
    if kind == "gamma":
        return arr.gamma(rate, duration_s, cv, seed), None
    if kind == "trace":
        return arr.trace(trace_path, rate, duration_s, seed)
    raise ValueError(f"arrivals '{kind}' is not known; use poisson, gamma or trace")


# ------------------------------------------------------------------------------ the run
async def _poll_status(session, url: str, every_s: float, t0: float, out: list, stop: asyncio.Event) -> None:
    import aiohttp

    while not stop.is_set():
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    out.append({"t_s": time.perf_counter() - t0, "status": await resp.json()})
        except Exception:  # noqa: BLE001 - a missed poll is only a gap in the plot
            pass
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_s)
        except TimeoutError:
            pass


async def run_async(
    base_url: str,
    schedule: Sequence[Planned],
    *,
    timeout_s: float = 30.0,
    conn_limit: int = 0,
    path: Callable[[str], str] = lambda m: f"/v1/models/{m}/infer",
    status_url: str | None = None,
    status_every_s: float = 1.0,
) -> RunResult:
    """Fire ``schedule`` open loop at ``base_url``; one ``Record`` per planned request."""
    import aiohttp

    records = [Record(i, p.model, p.t_s, tokens=p.tokens) for i, p in enumerate(schedule)]
    urls = {m: base_url.rstrip("/") + path(m) for m in {p.model for p in schedule}}
    connector = aiohttp.TCPConnector(limit=conn_limit, limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Content-Type": "application/json"}
    samples: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        t0_wall = time.time()
        stop = asyncio.Event()
        poller = None
        if status_url:
            poller = asyncio.create_task(_poll_status(session, status_url, status_every_s, t0, samples, stop))

        async def one(i: int, p: Planned) -> None:
            rec = records[i]
            rec.send_s = time.perf_counter() - t0
            try:
                async with session.post(urls[p.model], data=p.body, headers=headers) as resp:
                    payload = await resp.read()
                    rec.status = resp.status
                    if resp.status == STATUS_OK:
                        _read_tags(rec, payload)
                    else:
                        rec.error = payload[:200].decode(errors="replace")
            except TimeoutError:
                rec.status, rec.error = STATUS_CLIENT_FAIL, f"client timeout after {timeout_s:g}s"
            except Exception as exc:  # noqa: BLE001 - a failed request is a record, not a crash
                rec.status, rec.error = STATUS_CLIENT_FAIL, repr(exc)[:200]
            rec.finish_s = time.perf_counter() - t0
            rec.latency_ms = (rec.finish_s - rec.sched_s) * 1000.0

        tasks = []
        for i, p in enumerate(schedule):
            delay = p.t_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, p)))
        if tasks:
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        stop.set()
        if poller is not None:
            await poller
    duration = max((p.t_s for p in schedule), default=0.0)
    return RunResult(records, duration, wall, samples, t0_wall)


def _read_tags(rec: Record, payload: bytes) -> None:
    """Server latency and the batch tags of a 200 body (``bench.tagged``), when present."""
    try:
        doc = json.loads(payload)
    except ValueError:
        return
    if isinstance(doc, list):  # BentoML batchable APIs answer the list itself
        out = doc[0] if doc else None
    elif isinstance(doc, dict):
        rec.server_ms = doc.get("latency_ms")
        out = doc.get("output")
        if out is None and isinstance(doc.get("outputs"), list) and doc["outputs"]:
            out = doc["outputs"][0]
    else:
        return
    if isinstance(out, dict) and "_batch" in out:
        rec.batch, rec.batch_cost, rec.batch_ms = out.get("_batch"), out.get("_cost"), out.get("_batch_ms")
        stamps = {k: out[k] for k in ("_t_val", "_t0", "_t1") if isinstance(out.get(k), (int, float))}
        rec.stamps = stamps or None


def run(base_url: str, schedule: Sequence[Planned], **kw: Any) -> RunResult:
    """Blocking wrapper around ``run_async`` (one event loop per call)."""
    return asyncio.run(run_async(base_url, schedule, **kw))


# ------------------------------------------------------------------------------ summary
def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (None when empty), the convention of ``gpubroker.broker.control.window``."""
    if len(values) == 0:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s) - 1e-9) - 1))
    return float(s[k])


@dataclass
class ModelSummary:
    model: str
    window_s: float
    offered: int
    completed: int
    good: int  # completed within the cap
    rejections: int  # 503 (queue full, admission paused, Serve back-pressure)
    timeouts: int  # 504 and client-side timeouts
    errors: int  # anything else (5xx, connection errors, never sent)
    offered_rps: float
    completed_rps: float
    goodput_rps: float
    attainment: float  # good / offered
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    cap_ms: float | None
    send_lag_p99_ms: float | None  # how late the client sent (its own overload shows here)
    throughput_rps: float  # 200s that *finished* inside the window, per second (service rate under overload)
    passes: bool | None  # attainment ≥ 0.99: answered within the cap / offered (None without a cap)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 4)
        return d


def summarize(
    records: Sequence[Record],
    duration_s: float,
    caps_ms: Mapping[str, float] | float | None = None,
    *,
    warmup_s: float = 0.0,
    cooldown_s: float = 0.0,
) -> dict[str, ModelSummary]:
    """Per-model summary of the requests scheduled in ``[warmup_s, duration_s − cooldown_s)``."""
    lo, hi = warmup_s, duration_s - cooldown_s
    if hi <= lo:
        raise ValueError(
            f"warmup_s ({warmup_s}) + cooldown_s ({cooldown_s}) leave nothing of duration_s ({duration_s})"
        )
    window = hi - lo
    by_model: dict[str, list[Record]] = {}
    for r in records:
        if lo <= r.sched_s < hi:
            by_model.setdefault(r.model, []).append(r)
    out = {}
    for model, recs in sorted(by_model.items()):
        cap = caps_ms.get(model) if isinstance(caps_ms, Mapping) else caps_ms
        ok = [r for r in recs if r.status == STATUS_OK and r.latency_ms is not None]
        lat = [r.latency_ms for r in ok]
        good = sum(1 for x in lat if cap is None or x <= cap)
        rej = sum(1 for r in recs if r.status == 503)
        tmo = sum(
            1
            for r in recs
            if r.status in (504, STATUS_CLIENT_FAIL) and (r.status == 504 or "timeout" in (r.error or ""))
        )
        err = len(recs) - len(ok) - rej - tmo
        lags = [max(0.0, (r.send_s - r.sched_s) * 1000.0) for r in recs if r.send_s is not None]
        done_in = sum(
            1
            for r in records
            if r.model == model and r.status == STATUS_OK and r.finish_s is not None and lo <= r.finish_s < hi
        )
        p95 = percentile(lat, 95)
        passes = None
        if cap is not None:
            passes = bool(recs) and good >= ATTAINMENT_MIN * len(recs)
        out[model] = ModelSummary(
            model=model,
            window_s=window,
            offered=len(recs),
            completed=len(ok),
            good=good,
            rejections=rej,
            timeouts=tmo,
            errors=err,
            offered_rps=len(recs) / window,
            completed_rps=len(ok) / window,
            goodput_rps=good / window,
            attainment=good / len(recs) if recs else 0.0,
            p50_ms=percentile(lat, 50),
            p95_ms=p95,
            p99_ms=percentile(lat, 99),
            cap_ms=cap,
            send_lag_p99_ms=percentile(lags, 99),
            throughput_rps=done_in / window,
            passes=passes,
        )
    return out


def total_goodput(summary: Mapping[str, ModelSummary]) -> float:
    return sum(s.goodput_rps for s in summary.values())


def all_pass(summary: Mapping[str, ModelSummary]) -> bool:
    """Every model with offered load passes (the knee criterion)."""
    return all(s.passes for s in summary.values() if s.offered > 0)


def batch_stats(
    records: Sequence[Record], model: str | None = None, *, lo_s: float = 0.0, hi_s: float = float("inf")
) -> dict[str, Any]:
    """Mean batch (request-weighted: the batch a request ran in) and the L(b) = a + c·b fit
    from the batch tags of the completed requests scheduled in ``[lo_s, hi_s)``."""
    from gpubroker.broker.control.latency_model import fit_latency

    recs = [
        r for r in records if r.batch is not None and (model is None or r.model == model) and lo_s <= r.sched_s < hi_s
    ]
    if not recs:
        return {"mean_batch": None, "mean_batch_cost": None, "fit_a_ms": None, "fit_c_ms": None, "fit_batches": 0}
    # one point per batch: requests of a batch share (cost, ms); dedupe on that pair
    pts = sorted({(float(r.batch_cost), float(r.batch_ms)) for r in recs if r.batch_cost and r.batch_ms is not None})
    fit = fit_latency(pts) if len(pts) >= 3 else None
    return {
        "mean_batch": float(np.mean([r.batch for r in recs])),
        "mean_batch_cost": float(np.mean([r.batch_cost or 0 for r in recs])),
        "fit_a_ms": None if fit is None or fit.samples == 0 else round(fit.a_ms, 3),
        "fit_c_ms": None if fit is None or fit.samples == 0 else round(fit.c_ms, 5),
        "fit_batches": len(pts),
    }


def mean_batch(samples: Sequence[Mapping[str, Any]], model: str) -> float | None:
    """Mean batch size from broker status polls: completions-weighted mean of the replicas'
    reported batch sizes when the status carries them (``mean_batch``), else None."""
    vals = [
        s["status"]["models"][model].get("mean_batch")
        for s in samples
        if model in s.get("status", {}).get("models", {})
    ]
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else None


def status_series(samples: Sequence[Mapping[str, Any]], model: str, keys: Sequence[str]) -> dict[str, list]:
    """Time series of ``keys`` of one model from the status polls: {"t_s": [...], key: [...]}."""
    out: dict[str, list] = {"t_s": []}
    for k in keys:
        out[k] = []
    for s in samples:
        m = s.get("status", {}).get("models", {}).get(model)
        if m is None:
            continue
        out["t_s"].append(round(float(s["t_s"]), 3))
        for k in keys:
            out[k].append(m.get(k))
    return out


def settings_seen(
    samples: Sequence[Mapping[str, Any]], model: str, lo_s: float = 0.0, hi_s: float = float("inf")
) -> dict[str, Any]:
    """The batch cap and wait timeout the status polls showed for ``model`` in ``[lo_s, hi_s)``:
    median, min and max of each (None when no poll saw the model)."""
    ser = status_series(
        [s for s in samples if lo_s <= float(s.get("t_s", 0.0)) < hi_s],
        model,
        ("max_batch_size", "batch_wait_timeout_s"),
    )
    out: dict[str, Any] = {}
    for k in ("max_batch_size", "batch_wait_timeout_s"):
        v = [float(x) for x in ser[k] if x is not None]
        out[k] = {"median": float(np.median(v)), "min": min(v), "max": max(v)} if v else None
    return out


def seeds_table(per_seed: Sequence[Mapping[str, ModelSummary]]) -> dict[str, dict[str, Any]]:
    """Mean and spread over seeds of each model's headline metrics."""
    models = sorted({m for s in per_seed for m in s})
    out = {}
    for m in models:
        rows = [s[m] for s in per_seed if m in s]

        def agg(key: str, rows: list = rows) -> dict[str, float | None]:
            vals = [getattr(r, key) for r in rows if getattr(r, key) is not None]
            if not vals:
                return {"mean": None, "min": None, "max": None}
            return {"mean": float(np.mean(vals)), "min": float(min(vals)), "max": float(max(vals))}

        out[m] = {
            k: agg(k)
            for k in ("offered_rps", "completed_rps", "goodput_rps", "attainment", "p50_ms", "p95_ms", "p99_ms")
        }
        out[m]["passes_all"] = all(bool(r.passes) for r in rows)
        out[m]["rejections"] = sum(r.rejections for r in rows)
        out[m]["timeouts"] = sum(r.timeouts for r in rows)
        out[m]["errors"] = sum(r.errors for r in rows)
    return out
