"""CPU time per request on the serving path: the gpubroker fleet vs plain Serve vs BentoML.

Every arm serves the same near-free model (the ``profiled`` emulation sleeping ``a + c·b``, no
memory touched: the model itself costs no CPU), at the same open-loop Poisson rate, so what the
processes burn is the serving path. Per arm, each server process's CPU time (utime + stime from
``/proc/<pid>/stat``, all threads) is read before and after the measured run; the same
processes' idle burn (health checks, report loops), measured for ``idle_s`` just before, is
subtracted; the rest divided by the answered requests is the CPU time per request. All arms are
deployed at once (their own route prefixes; the one Serve proxy is shared) and measured in
``--rounds`` interleaved rounds, each in a rotated order, so a neighbour's load on the machine
drifts over every arm alike; the tables give the median round.

Processes per arm (the client runs in this process and is not counted):

- ``fleet``: Serve's HTTP proxy and the model replica (one hop), and beside them the broker
  actor and the fleet API replica (not on the request path: reports and status);
  ``fleet-pinned`` is the same fleet held static at plain's batch and wait;
- ``fleet-direct``: the same fleet with ``broker.direct_ingress``, the load sent to the model
  replica's own port (``gpubroker.deployments.serve.direct_ingress``: no proxy on the path; the proxy is still
  counted, and idles). Any ``-direct`` arm starts Ray with Serve's direct ingress for every arm;
  the proxy arms then run beside it unchanged;
- ``plain``: the proxy, the FastAPI ingress replica and the ``@serve.batch`` replica
  (``bench/plain_serve.py``, two hops: the shape the fleet had before);
- ``plain-1hop``: the proxy and a ``@serve.batch`` replica answering HTTP itself (one hop);
- ``bentoml``: every process under ``bentoml serve``, when a BentoML venv exists.

``--profile`` adds one more run per arm under ``py-spy record --nonblocking`` on each of its
processes and says where their busy samples fall (by activity: the innermost frame that names
one). Run::

    .venv/bin/python -m bench.cost_per_request --rounds 3 --profile \
        --out bench/out/cost_per_request.json [--peer-venv bench/peer/.venv-bentoml]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench import loadgen as lg
from bench import scenarios as sc
from gpubroker.sim import arrivals as arr

CLK_TCK = os.sysconf("SC_CLK_TCK")
MODEL = "prof"
OPTIONS = {"a_ms": 5.0, "c_ms": 0.2, "weights_bytes": 0, "bytes_per_item": 0, "unit": "requests"}
BATCH, WAIT_MS = 16, 5.0
PEER_MAX_LATENCY_MS = 1000.0
BODY = lg.default_body("profiled")
PY_SPY = Path(sys.executable).with_name("py-spy")


def cpu_s(pid: int) -> float:
    """utime + stime of one process (all its threads), in seconds; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def descendants(root: int) -> list[int]:
    """``root`` and every process under it (by parent pid)."""
    parent: dict[int, int] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parent[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [root], [root]
    while todo:
        cur = todo.pop()
        kids = [pid for pid, pp in parent.items() if pp == cur]
        out.extend(kids)
        todo.extend(kids)
    return out


def _pid_of(name: str, namespace: str) -> int:
    import ray

    return int(
        ray.get(ray.get_actor(name, namespace=namespace).__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
    )


def serve_pids(app_prefixes: dict[str, str], broker_name: str | None = None) -> dict[str, int]:
    """Role -> pid: the HTTP proxy, replicas whose actor name starts with a prefix, the broker
    (named actors of this Ray instance, each asked for its pid)."""
    import ray

    roles: dict[str, int] = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        name, ns = a["name"], a["namespace"]
        if ns == "serve" and name.startswith("SERVE_PROXY_ACTOR"):
            roles["proxy"] = _pid_of(name, ns)
        elif broker_name and name == broker_name:
            roles["broker"] = _pid_of(name, ns)
        for role, prefix in app_prefixes.items():
            if ns == "serve" and name.startswith(f"SERVE_REPLICA::{prefix}"):
                roles[role] = _pid_of(name, ns)
    return roles


def measure_cpu(
    pids: dict[str, int], base_url: str, rate: float, duration_s: float, seed: int, idle_s: float
) -> dict[str, Any]:
    """Idle burn, then one open-loop run: CPU ms per answered request, per process and in all."""
    t0 = {r: cpu_s(p) for r, p in pids.items()}
    time.sleep(idle_s)
    idle = {r: (cpu_s(p) - t0[r]) / idle_s for r, p in pids.items()}  # CPU s per s
    sched = lg.plan(MODEL, arr.poisson(rate, duration_s, seed), BODY)
    c0 = {r: cpu_s(p) for r, p in pids.items()}
    w0 = time.time()
    run = lg.run(base_url, sched, timeout_s=30.0)
    wall = time.time() - w0
    c1 = {r: cpu_s(p) for r, p in pids.items()}
    ok = [x for x in run.records if x.status == 200]
    n = max(1, len(ok))
    per = {r: max(0.0, (c1[r] - c0[r]) - idle[r] * wall) * 1000.0 / n for r in pids}
    lat = sorted(x.latency_ms for x in ok)
    return {
        "offered": len(sched),
        "answered": len(ok),
        "wall_s": round(wall, 2),
        "cpu_ms_per_request": {r: round(v, 3) for r, v in per.items()},
        "idle_cpu_frac": {r: round(v, 4) for r, v in idle.items()},
        "p50_ms": lg.percentile(lat, 50),
        "p95_ms": lg.percentile(lat, 95),
        "errors": dict(Counter(x.status for x in run.records if x.status != 200)),
    }


# ------------------------------------------------------------------------------ profile
ACTIVITIES = (  # frame -> activity; a stack goes to the first frame, leaf to root, that names one
    ("ray/util/metrics.py", "Ray metrics (Metric._record)"),
    ("_actor_method_call", "Ray actor call submit (.remote)"),
    ("ray/serve/_private/router.py", "Serve router (replica choice, queue)"),
    ("ray/serve/_private/replica_result.py", "Serve result / rejection check"),
    ("ray/serve/_private/proxy", "Serve proxy (request, response)"),
    ("ray/serve/_private/http_util.py", "Serve ASGI plumbing (receive/send)"),
    ("ray/serve/_private/replica.py", "Serve replica (call wrapper)"),
    ("deployments/models/", "model adapter (deployments/models/)"),
    ("deployments/", "gpubroker (deployments/)"),
    ("broker/", "gpubroker (broker/)"),
    ("bench/", "model (bench/)"),
    ("uvicorn", "HTTP server (uvicorn/h11/httptools)"),
    ("h11", "HTTP server (uvicorn/h11/httptools)"),
    ("httptools", "HTTP server (uvicorn/h11/httptools)"),
    ("starlette", "ASGI framework (starlette/fastapi)"),
    ("fastapi", "ASGI framework (starlette/fastapi)"),
    ("pydantic", "pydantic"),
    ("ray/serve/", "Ray Serve (other)"),
    ("json", "serialization (json/pickle)"),
    ("pickle", "serialization (json/pickle)"),
    ("concurrent/futures", "thread pool (to_thread)"),
    ("ray/_private/worker.py", "Ray core worker loop (native)"),
    ("asyncio", "asyncio event loop"),
    ("threading.py", "native thread (Ray core / gRPC, no Python frame)"),
)
OURS = ("deployments/", "broker/")


def activity_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for key, name in ACTIVITIES:
            if key in frame:
                return name
    return "other"


def py_spy(pid: int, duration_s: float, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(PY_SPY),
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(int(duration_s)),
            "--rate",
            "250",
            "--nonblocking",
            "--format",
            "raw",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def summarize_profile(path: Path, top: int = 8) -> dict[str, Any]:
    """Collapsed stacks -> share of busy samples per activity, our code's inclusive share, and
    the top leaf frames."""
    groups: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = ours = 0
    if not path.exists():
        return {"samples": 0}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        total += n
        groups[activity_of(frames)] += n
        leaves[frames[-1][:110]] += n
        if any(
            k in f and "http_proxy.py" not in f and "deployments/models/" not in f  # the middleware wraps
            for f in frames
            for k in OURS
        ):  # everything; the adapters are the model's code
            ours += n
    if not total:
        return {"samples": 0}
    return {
        "samples": total,
        "ours_inclusive": round(ours / total, 3),
        "activities": {g: round(v / total, 3) for g, v in groups.most_common()},
        "top_leaves": [(f, round(v / total, 3)) for f, v in leaves.most_common(top)],
    }


def profile_run(
    pids: dict[str, int], base_url: str, rate: float, duration_s: float, tmp: Path, tag: str
) -> dict[str, Any]:
    sched = lg.plan(MODEL, arr.poisson(rate, duration_s + 2.0, 99), BODY)
    procs = {r: py_spy(p, duration_s, tmp / f"{tag}-{r}.txt") for r, p in pids.items()}
    lg.run(base_url, sched, timeout_s=30.0)
    for p in procs.values():
        p.wait(timeout=60)
    return {r: summarize_profile(tmp / f"{tag}-{r}.txt") for r in pids}


# ------------------------------------------------------------------------------ arms
@dataclass
class Target:
    """One arm, deployed: where to send, whose CPU to count, how to take it down."""

    base_url: str
    pids: dict[str, int]
    close: Any
    runs: list[dict[str, Any]] = field(default_factory=list)


def fleet_target(stack: sc.Stack, pinned: bool, direct: bool = False) -> Target:
    """The broker fleet (one hop); ``pinned``: the same fleet held static at plain's batch and wait;
    ``direct``: the load goes to the replica's own port (direct ingress)."""
    spec = sc.profiled_spec(OPTIONS["a_ms"], OPTIONS["c_ms"], 2000.0, weights_bytes=0, bytes_per_item=0, ceiling=64)
    if pinned:
        spec = sc.pin_static(spec, BATCH, WAIT_MS)
    app = "pin-cost" if pinned else "direct-cost" if direct else "fleet-cost"
    broker = f"bench-{app}-{int(time.time()) % 10**6}"
    tgt = stack.deploy_fleet(
        sc.fleet_yaml({MODEL: spec}, broker_name=broker, http_port=stack.port, direct_ingress=direct),
        app=app,
        route_prefix=f"/{app}",
        warm_models={MODEL: BODY},
    )
    pids = serve_pids({"replica": f"{app}-{MODEL}#", "fleet_api": f"{app}#"}, broker)
    return Target(tgt.infer_base, pids, tgt.delete)  # direct: the replica's port (a one-model fleet)


def plain_target(stack: sc.Stack) -> Target:
    tgt = stack.deploy_plain(
        sc.TAGGED["profiled"],
        OPTIONS,
        BATCH,
        WAIT_MS,
        MODEL,
        app="plain-cost",
        route_prefix="/plain-cost",
        warm_body=BODY,
    )
    return Target(
        tgt.base_url, serve_pids({"ingress": "plain-cost#ingress#", "replica": f"plain-cost#{MODEL}#"}), tgt.delete
    )


def plain_one_hop_target(stack: sc.Stack) -> Target:
    from ray import serve

    from bench.plain_serve import build_plain_one_hop

    app, prefix = "plain1-cost", "/plain1-cost"
    serve.run(
        build_plain_one_hop(sc.TAGGED["profiled"], OPTIONS, BATCH, WAIT_MS, MODEL),
        name=app,
        route_prefix=f"{prefix}/v1/models/{MODEL}",
        blocking=False,
    )
    base = stack.base_url + prefix
    for _ in range(3):
        sc.wait_http(f"{base}/v1/models/{MODEL}/infer", json.loads(BODY), timeout_s=180)
    return Target(base, serve_pids({"replica": f"{app}#{MODEL}#"}), lambda: serve.delete(app, _blocking=True))


def bentoml_target(args: argparse.Namespace, tmp: Path) -> Target | None:
    from bench.peer import runner

    venv = Path(args.peer_venv) if args.peer_venv else runner.PEER_VENV
    if not (venv / "bin" / "bentoml").exists():
        return None
    runner.PEER_VENV = venv
    # its max_latency_ms is a latency budget (past it BentoML answers 503), not a wait: a loose one
    peer = runner.PeerServer(
        sc.TAGGED["profiled"],
        OPTIONS,
        MODEL,
        BATCH,
        PEER_MAX_LATENCY_MS,
        sc.free_port(),
        log_path=str(tmp / "bentoml.log"),
    )
    try:
        peer.wait_ready(json.loads(BODY), timeout_s=180)
        for _ in range(3):
            sc.http_json(f"{peer.base_url}/v1/models/{MODEL}/infer", json.loads(BODY))
    except Exception:
        peer.delete()
        raise
    return Target(peer.base_url, {f"bentoml-{p}": p for p in descendants(peer.proc.pid)}, peer.delete)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median CPU ms per request over the rounds, per process and on the serving path."""

    def path_ms(run: dict[str, Any]) -> float:
        return sum(v for r, v in run["cpu_ms_per_request"].items() if r not in ("broker", "fleet_api"))

    per_round = [round(path_ms(r), 3) for r in runs]
    roles = runs[0]["cpu_ms_per_request"]
    return {
        "serving_path_cpu_ms": float(np.median(per_round)),
        "rounds_cpu_ms": per_round,
        "cpu_ms_per_request": {
            k: round(float(np.median([r["cpu_ms_per_request"][k] for r in runs])), 3) for k in roles
        },
        "p50_ms": float(np.median([r["p50_ms"] for r in runs if r["p50_ms"] is not None])),
        "p95_ms": float(np.median([r["p95_ms"] for r in runs if r["p95_ms"] is not None])),
        "answered": sum(r["answered"] for r in runs),
        "offered": sum(r["offered"] for r in runs),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=40.0, help="offered requests per second (Poisson)")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of load per arm and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every arm once, in a rotated order")
    ap.add_argument("--idle", type=float, default=4.0, help="seconds of idle burn measured before each run")
    ap.add_argument("--profile", action="store_true", help="one more run per arm under py-spy")
    ap.add_argument("--profile-s", type=float, default=12.0)
    ap.add_argument("--arms", default="fleet,fleet-pinned,plain,plain-1hop,bentoml")
    ap.add_argument("--peer-venv", default=None, help="a venv with bentoml (default bench/peer/.venv-bentoml)")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    res: dict[str, Any] = {
        "scenario": "cost_per_request",
        "machine": sc.machine_info(),
        "rate_rps": args.rate,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "model_options": OPTIONS,
        "batch": BATCH,
        "wait_ms": WAIT_MS,
        "command": "python -m bench.cost_per_request " + " ".join(argv if argv is not None else sys.argv[1:]),
        "arms": {},
    }
    targets: dict[str, Target] = {}
    direct = any(arm.endswith("-direct") for arm in arms)
    with tempfile.TemporaryDirectory() as d, sc.Stack(direct_ingress=direct) as stack:
        tmp = Path(d)
        try:
            builders = {
                "fleet": lambda: fleet_target(stack, False),
                "fleet-pinned": lambda: fleet_target(stack, True),
                "fleet-direct": lambda: fleet_target(stack, False, direct=True),
                "plain": lambda: plain_target(stack),
                "plain-1hop": lambda: plain_one_hop_target(stack),
                "bentoml": lambda: bentoml_target(args, tmp),
            }
            for arm in arms:
                t = builders[arm]()
                if t is None:
                    print(f"{arm}: no venv with bentoml (make bench-peer-venv, or --peer-venv PATH); skipped")
                    continue
                targets[arm] = t
            proxy = serve_pids({}).get("proxy")  # every Serve arm shares the one proxy
            for arm, t in targets.items():
                if not arm.startswith("bentoml") and proxy:
                    t.pids["proxy"] = proxy
            order = list(targets)
            for k in range(args.rounds):  # interleaved: load on the machine drifts over all arms alike
                for arm in order[k % len(order) :] + order[: k % len(order)]:
                    t = targets[arm]
                    run = measure_cpu(t.pids, t.base_url, args.rate, args.duration, k, args.idle)
                    t.runs.append(run)
                    print(f"round {k} {arm:<12} " + json.dumps(run["cpu_ms_per_request"]), flush=True)
            for arm, t in targets.items():
                res["arms"][arm] = {"pids": t.pids, "runs": t.runs, **summary(t.runs)}
                if args.profile:
                    busy = {r: p for r, p in t.pids.items() if r not in ("broker", "fleet_api")}
                    res["arms"][arm]["profile"] = profile_run(busy, t.base_url, args.rate, args.profile_s, tmp, arm)
        finally:
            for t in targets.values():
                try:
                    t.close()
                except Exception:  # noqa: BLE001
                    pass
    for arm, doc in res["arms"].items():
        print(
            f"{arm:<12} serving path {doc['serving_path_cpu_ms']:7.3f} CPU ms/request (median of {doc['rounds_cpu_ms']})  "
            + "  ".join(f"{r} {v:.3f}" for r, v in doc["cpu_ms_per_request"].items())
            + f"  P50 {doc['p50_ms']:.0f} ms P95 {doc['p95_ms']:.0f} ms  answered {doc['answered']}/{doc['offered']}"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
