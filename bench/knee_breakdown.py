"""Where a request's latency goes near the knee: the broker fleet vs BentoML, side by side.

One stack, every arm deployed at once (the fleet under its own route prefix, BentoML in its
own process), the same Poisson arrivals per (rate, seed) for every arm, arms interleaved in a
rotated order each round, so a neighbour's load on a shared machine drifts over all of them
alike. Per request, from the wall-clock stamps ``bench.tagged`` puts in each output (one
machine, one clock) and the client's own send and receive times:

- ``lag``: the client sent late (scheduled -> sent);
- ``in``: sent -> validated (proxy, HTTP, body read, admission, the thread hop to ``validate``);
  for BentoML, whose ``validate`` runs inside the batch, ``in`` is everything up to the batch;
- ``wait``: validated -> its batch's predict started (the lazy gate, Serve's batcher, the
  thread hop to predict): the queue;
- ``compute``: the batch's predict;
- ``out``: predict ended -> the client had the answer (the thread hop back, Serve's result,
  the proxy, HTTP).

Each component's mean, P50 and its mean over the slowest 10 % of requests (the tail that sets
P95), the mean batch and predict time by batch size, and the CPU each process burned during the
run (cores: CPU s per wall s; the replica's busiest threads; the whole machine from
``/proc/stat``, so other jobs' load shows). Run::

    .venv/bin/python -m bench.knee_breakdown --workload minilm --rates 23.4,26 --rounds 2 \
        --peer-venv bench/peer/.venv-bentoml --out bench/out/breakdown-minilm.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import loadgen as lg
from bench import scenarios as sc
from bench.cost_per_request import CLK_TCK, cpu_s, descendants, serve_pids
from bench.live_runs import Opts, Workload, knee_arrivals, minilm_workload, profiled_workload
from gpubroker.deployments.serve.http_model import HttpModel

PARTS = ("lag", "in", "wait", "compute", "out")


class HttpModelResultsFirst(HttpModel):
    """The model deployment with the order before ``gpubroker.deployments.replica.next_batch``: a batch's results
    are sent before the next batch starts (arm ``results-first``)."""

    START_NEXT_FIRST = False


# ------------------------------------------------------------------------------ CPU
def machine_busy() -> tuple[float, float]:
    """(busy jiffies, total jiffies) of the whole machine, from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return float(sum(f) - idle), float(sum(f))


def threads_cpu(pid: int) -> dict[str, float]:
    """tid:comm -> CPU s of each thread of ``pid``."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        comm = raw[raw.find("(") + 1 : raw.rfind(")")]
        f = raw.rsplit(")", 1)[1].split()
        out[f"{tid}:{comm}"] = (int(f[11]) + int(f[12])) / CLK_TCK
    return out


class CpuWatch:
    """CPU of named processes (and one process's threads) over an interval, in cores."""

    def __init__(self, pids: dict[str, int], thread_pid: int | None = None):
        self.pids, self.thread_pid = pids, thread_pid

    def __enter__(self) -> CpuWatch:
        self.w0 = time.time()
        self.c0 = {r: cpu_s(p) for r, p in self.pids.items()}
        self.t0 = threads_cpu(self.thread_pid) if self.thread_pid else {}
        self.m0 = machine_busy()
        return self

    def __exit__(self, *_exc: Any) -> None:
        wall = max(1e-6, time.time() - self.w0)
        self.cores = {r: round((cpu_s(p) - self.c0[r]) / wall, 3) for r, p in self.pids.items()}
        t1 = threads_cpu(self.thread_pid) if self.thread_pid else {}
        th = {k: (v - self.t0.get(k, 0.0)) / wall for k, v in t1.items()}
        self.threads = {k: round(v, 3) for k, v in sorted(th.items(), key=lambda kv: -kv[1])[:5] if v > 0.005}
        m1 = machine_busy()
        self.machine_cores = round((m1[0] - self.m0[0]) / max(1.0, m1[1] - self.m0[1]) * (os.cpu_count() or 1), 3)
        self.others_cores = round(self.machine_cores - sum(self.cores.values()), 3)


# ------------------------------------------------------------------------------ per request
def parts_of(rec: lg.Record, t0_wall: float) -> dict[str, float] | None:
    s = rec.stamps or {}
    if rec.status != 200 or rec.send_s is None or rec.finish_s is None or "_t0" not in s or "_t_val" not in s:
        return None
    send, recv = t0_wall + rec.send_s, t0_wall + rec.finish_s
    return {
        "lag": (rec.send_s - rec.sched_s) * 1e3,
        "in": (s["_t_val"] - send) * 1e3,
        "wait": (s["_t0"] - s["_t_val"]) * 1e3,
        "compute": (s["_t1"] - s["_t0"]) * 1e3,
        "out": (recv - s["_t1"]) * 1e3,
    }


def breakdown(res: lg.RunResult, lo_s: float, hi_s: float, cap_ms: float) -> dict[str, Any]:
    """Latency parts of the requests scheduled in [lo_s, hi_s): mean, P50, mean over the slowest 10 %."""
    recs = [r for r in res.records if lo_s <= r.sched_s < hi_s]
    ok = [(r, parts_of(r, res.t0_wall)) for r in recs]
    ok = [(r, p) for r, p in ok if p is not None]
    lat = np.array([r.latency_ms for r, _ in ok]) if ok else np.array([0.0])
    tail_cut = float(np.percentile(lat, 90))
    out: dict[str, Any] = {
        "offered": len(recs),
        "answered": len(ok),
        "attainment": round(sum(1 for r in recs if r.status == 200 and r.latency_ms <= cap_ms) / max(1, len(recs)), 3),
        "p50_ms": round(float(np.percentile(lat, 50)), 1),
        "p95_ms": round(float(np.percentile(lat, 95)), 1),
        "mean_batch": round(float(np.mean([r.batch for r, _ in ok if r.batch])), 2) if ok else None,
    }
    for k in PARTS:
        v = np.array([p[k] for _, p in ok]) if ok else np.array([0.0])
        tail = np.array([p[k] for r, p in ok if r.latency_ms >= tail_cut]) if ok else v
        out[k] = {
            "mean": round(float(v.mean()), 1),
            "p50": round(float(np.percentile(v, 50)), 1),
            "tail_mean": round(float(tail.mean()), 1),
        }
    by_b: dict[str, list[float]] = {}
    for r, p in ok:
        key = str(r.batch) if (r.batch or 0) < 4 else "4+"
        by_b.setdefault(key, []).append(p["compute"])
    out["compute_by_batch_ms"] = {k: [round(float(np.median(v)), 1), len(v)] for k, v in sorted(by_b.items())}
    # the replica's turnaround: from one batch's end to the next one's start, when the next
    # batch holds a request that had been validated before the previous batch ended (work waited)
    batches: dict[tuple[float, float], float] = {}
    for r, _p in ok:
        s = r.stamps or {}
        key = (s["_t0"], s["_t1"])
        batches[key] = min(batches.get(key, math.inf), s["_t_val"])
    seq = sorted(batches.items())
    gaps = [(b[0][0] - a[0][1]) * 1e3 for a, b in zip(seq, seq[1:]) if b[1] < a[0][1]]
    busy = sum(t1 - t0 for (t0, t1), _v in seq)
    span = (seq[-1][0][1] - seq[0][0][0]) if len(seq) > 1 else 0.0
    out["turnaround_ms"] = {"p50": round(float(np.median(gaps)), 2), "n": len(gaps)} if gaps else None
    out["busy_frac"] = round(busy / span, 3) if span > 0 else None
    return out


# ------------------------------------------------------------------------------ arms
def deploy_broker(
    stack: sc.Stack, w: Workload, cap_ms: float, tag: str, spec_edit: dict[str, Any] | None, model_cls: Any = None
) -> Any:
    spec = w.spec(cap_ms)
    spec["batch"]["initial"] = 8 * w.tokens if w.kind == "minilm" else 8
    for k, v in (spec_edit or {}).items():  # e.g. {"options": {...}} for a variant
        spec[k] = {**spec.get(k, {}), **v} if isinstance(v, dict) else v
    broker = f"bench-kb-{tag}-{int(time.time() * 1000) % 10**8}"
    text = sc.fleet_yaml({w.model: spec}, broker_name=broker, http_port=stack.port)
    tgt = stack.deploy_fleet(
        text, app=f"kb-{tag}", route_prefix=f"/kb-{tag}", warm_models={w.model: w.body}, model_cls=model_cls
    )
    pids = serve_pids({"replica": f"kb-{tag}-{w.model}#"}, broker)
    return tgt, pids


def deploy_bentoml(w: Workload, cap_ms: float, venv: str) -> Any:
    from bench.peer import runner

    runner.PEER_VENV = Path(venv)
    p = runner.PeerServer(w.ref, w.options, w.model, 128, cap_ms, sc.free_port(), log_path="/tmp/gpubroker-kb-peer.log")
    p.wait_ready(json.loads(w.body), timeout_s=240)
    for _ in range(3):
        sc.http_json(f"{p.base_url}/v1/models/{w.model}/infer", json.loads(w.body))
    return p, {f"bentoml-{q}": q for q in descendants(p.proc.pid)}


def one_run(arm: dict[str, Any], w: Workload, o: Opts, rate: float, seed: int, cap_ms: float) -> dict[str, Any]:
    tgt = arm["target"]
    if hasattr(tgt, "idle"):
        tgt.idle()
    times, warm, duration = knee_arrivals(o, rate, seed, True)
    sched = lg.plan(w.model, times, w.body)
    _, client_t = (max(2.0, 5.0 * cap_ms / 1000.0), max(2.0, 5.0 * cap_ms / 1000.0) + 3.0)
    pids = dict(arm["pids"])
    pids["client"] = os.getpid()
    fleet = getattr(tgt, "kind", "") == "fleet"
    seq0 = sc.decisions_since(tgt, 0, w.model)[1] if fleet else 0
    with CpuWatch(pids, arm["pids"].get("replica")) as cw:
        res = lg.run(
            getattr(tgt, "infer_base", tgt.base_url),
            sched,
            timeout_s=client_t,
            status_url=getattr(tgt, "status_url", None),
        )
    row = breakdown(res, warm, duration - o.cooldown_s, cap_ms)
    row.update(arm=arm["name"], rate=rate, seed=seed, cores=cw.cores, replica_threads=cw.threads)
    row.update(machine_cores=cw.machine_cores, others_cores=cw.others_cores, load_avg=os.getloadavg()[0])
    if res.status_samples:
        st = lg.settings_seen(res.status_samples, w.model, warm, duration - o.cooldown_s)
        row["set_cap"] = (st.get("max_batch_size") or {}).get("median")
        wt = (st.get("batch_wait_timeout_s") or {}).get("median")
        row["set_wait_ms"] = None if wt is None else round(wt * 1000, 1)
    if fleet:  # what the broker set during the run, and why (its decision log)
        row["decisions"] = sc.decisions_since(tgt, seq0, w.model)[0][-12:]
    return row


def say(row: dict[str, Any]) -> str:
    parts = "  ".join(f"{k} {row[k]['mean']:.0f}/{row[k]['tail_mean']:.0f}" for k in PARTS)
    cores = " ".join(f"{k.split('-')[0]}={v:.2f}" for k, v in row["cores"].items())
    told = f" set {row.get('set_cap')}/{row.get('set_wait_ms')}ms" if "set_cap" in row else ""
    return (
        f"{row['arm']:<10} {row['rate']:6.2f}/s s{row['seed']} att {row['attainment']:.3f} P50 {row['p50_ms']:.0f} "
        f"P95 {row['p95_ms']:.0f} b {row['mean_batch']}{told} busy {row['busy_frac']} turn {row['turnaround_ms']} "
        f"| mean/tail10%: {parts} | cores {cores} "
        f"others={row['others_cores']:.2f} | threads {row['replica_threads']}"
    )


def table(doc: dict[str, Any]) -> str:
    """The rows of a run as a markdown table (``--report FILE``)."""
    head = (
        "| round | rate | arm | attainment | P50 | P95 | mean batch | set cap / wait | lag | in | wait | compute "
        "| out | turnaround p50 | busy | cores: path / model process | others' cores |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in doc["rows"]:
        parts = " | ".join(f"{r[k]['mean']:.0f} ({r[k]['tail_mean']:.0f})" for k in PARTS)
        told = f"{r['set_cap']:g} / {r['set_wait_ms']:g} ms" if r.get("set_cap") is not None else "–"
        turn = f"{r['turnaround_ms']['p50']:.1f}" if r.get("turnaround_ms") else "–"
        c = r["cores"]
        model = sum(v for k, v in c.items() if k == "replica" or k.startswith("bentoml"))
        path = c.get("proxy", 0.0)
        lines.append(
            f"| {r.get('round', 0)} | {r['rate']:g} | {r['arm']} | {r['attainment']:.3f} | {r['p50_ms']:.0f} | "
            f"{r['p95_ms']:.0f} | {r['mean_batch']} | {told} | {parts} | {turn} | {r.get('busy_frac')} | "
            f"{path:.2f} / {model:.2f} | {r['others_cores']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--workload",
        choices=("minilm", "profiled", "minilm-emu"),
        default="minilm",
        help="minilm-emu: the profiled emulation (it sleeps) with MiniLM's fitted a = 13.25, c = 15.3 ms: "
        "the same serving path and queue without the model's CPU",
    )
    ap.add_argument("--rates", default="23.4,26")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--cap-ms", type=float, default=None, help="default: the last full seed run's 1.2·S")
    ap.add_argument(
        "--arms",
        default="broker,bentoml",
        help="broker, results-first (the broker with a batch's results sent before the next batch starts), bentoml",
    )
    ap.add_argument("--variant", action="append", default=[], help="NAME=JSON: a broker arm with a spec edit")
    ap.add_argument("--peer-venv", default="bench/peer/.venv-bentoml")
    ap.add_argument("--quick", action="store_true", help="the --quick windows (100 requests, 5-16 s)")
    ap.add_argument(
        "--direct", action="store_true", help="Serve's direct ingress: the broker arms on the replica's port"
    )
    ap.add_argument(
        "--plain-window",
        action="store_true",
        help="draw each run's measured window plainly (its offered rate varies by seed) instead of "
        "with exactly rate x window arrivals (gpubroker.sim.arrivals.exact_count), as knee runs were drawn before",
    )
    ap.add_argument("--out", default="bench/out/breakdown.json")
    ap.add_argument("--report", default=None, help="print the table of a run's JSON and exit")
    a = ap.parse_args(argv)
    if a.report:
        print(table(json.loads(Path(a.report).read_text())))
        return {}
    if a.workload == "minilm":
        w = minilm_workload()
    elif a.workload == "minilm-emu":
        w = profiled_workload(1.0, a_ms=13.25, c_ms=15.3)
    else:
        w = profiled_workload(10.0)
    cap = a.cap_ms or (697.0 if a.workload == "profiled" else 214.0)
    o = Opts.make(a.quick, log=print, exact_window=not a.plain_window)
    rates = [float(x) for x in a.rates.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    names = [x for x in a.arms.split(",") if x]
    variants = dict(v.split("=", 1) for v in a.variant)
    rows: list[dict[str, Any]] = []
    with sc.Stack(direct_ingress=a.direct) as stack:
        arms: list[dict[str, Any]] = []
        try:
            for n in names + list(variants):
                if n == "bentoml":
                    tgt, pids = deploy_bentoml(w, cap, a.peer_venv)
                else:
                    edit = json.loads(variants[n]) if n in variants else None
                    cls = HttpModelResultsFirst if n == "results-first" else None
                    tgt, pids = deploy_broker(stack, w, cap, n.replace("_", "-"), edit, cls)
                arms.append({"name": n, "target": tgt, "pids": pids})
                print(f"[kb] {n} up: {pids}", flush=True)
            for rnd in range(a.rounds):
                for rate in rates:
                    for seed in seeds:
                        k = rnd % len(arms)
                        for arm in arms[k:] + arms[:k]:
                            row = one_run(arm, w, o, rate, seed, cap)
                            row["round"] = rnd
                            rows.append(row)
                            print(say(row), flush=True)
                            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                            doc = {"workload": w.label, "cap_ms": cap, "machine": sc.machine_info(), "rows": rows}
                            Path(a.out).write_text(json.dumps(doc, indent=1))
        finally:
            for arm in arms:
                try:
                    arm["target"].delete()
                except Exception as exc:  # noqa: BLE001
                    print(f"[kb] {arm['name']} delete failed: {exc!r}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
