#!/usr/bin/env python
"""`make demo`: the demo fleet on a local Ray, a short open-loop load with a burst, then status.

1. `gpubroker up configs/demo.yaml` (local `ray start --head`, broker actor, Serve app; waits
   until every model answers a real request);
2. open-loop load: Poisson arrival times for every model are drawn BEFORE the run, then sent
   over async HTTP: a warm phase, a burst on one model (minilm by default), a cool-down;
   a progress line every few seconds shows each model's batch cap, grant, queue and P95;
3. the status table and the broker's decisions during the run (batch caps following the load,
   quota moving to the busy model and back when its need outgrows its grant);
4. `gpubroker down`;
5. the same burst on a fixed split (every quota pinned at its base: nothing lends), and one
   line per arm for the burst model: attainment within its SLO, P95 of its answers, requests
   shed (504, ``shed_late``: too late for the SLO), OOM answers. The burst model (``prof``, an
   emulation that holds real memory under the enforced limit) gets 1.6x the items/s that the
   batch its base holds serves on this machine (timed before the load), so only borrowed memory
   serves its burst within the SLO; both arms shed, so the fixed split serves what its batches
   can instead of answering the whole burst late.

Runs in under 7 minutes on a 2-core machine (``--no-compare``: half that). The fleet's state file goes to a temporary
directory, so a fleet you already run is left alone; port 8000 is replaced by a free port if
it is taken.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GPUBROKER_STATE_DIR", tempfile.mkdtemp(prefix="gpubroker-demo-"))

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402

from gpubroker.cli.fleet import down, up_with_progress  # noqa: E402
from gpubroker.cli.views import describe_decision, status_table  # noqa: E402
from gpubroker.deployments.cluster.fleet import UpOptions, example_inputs  # noqa: E402
from gpubroker.deployments.cluster.local_ray import free_port, port_free  # noqa: E402
from gpubroker.quotas.config import FleetConfig, parse_config_text  # noqa: E402
from gpubroker.quotas.sizes import format_size  # noqa: E402

console = Console()
if not console.is_terminal:
    console = Console(width=170)
WORDS = (
    "broker",
    "quota",
    "batch",
    "latency",
    "memory",
    "gpu",
    "serve",
    "model",
    "token",
    "queue",
    "lend",
    "borrow",
    "idle",
    "busy",
    "cap",
    "wait",
    "profile",
    "price",
    "peak",
    "trough",
)


def poisson(rate: float, start_s: float, end_s: float, rng: random.Random) -> list[float]:
    t, out = start_s, []
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= end_s:
            break
        out.append(t)
    return out


def text_of(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def build_schedule(
    models: list[str],
    burst: str,
    examples: dict,
    phases: list[tuple[str, float, float, float]],
    seed: int = 7,
    burst_items: int = 4,
) -> list[tuple[float, str, dict]]:
    """(time, model, body) for the whole run, sorted; drawn before anything is sent."""
    rng = random.Random(seed)
    sched: list[tuple[float, str, dict]] = []
    t0 = 0.0
    for _phase, duration, base_rps, burst_rps in phases:
        for name in models:
            rate = burst_rps if name == burst else base_rps
            for at in poisson(rate, t0, t0 + duration, rng):
                if name == "minilm":
                    body = {"inputs": [{"text": text_of(rng, rng.randint(8, 40))} for _ in range(4)]}
                else:
                    body = {"inputs": [examples[name]] * (burst_items if name == burst else 4)}
                sched.append((at, name, body))
        t0 += duration
    sched.sort(key=lambda x: x[0])
    return sched


async def run_load(
    url: str,
    sched: list[tuple[float, str, dict]],
    total_s: float,
    models: list[str],
    seen: list[tuple[float, str, int, float]] | None = None,
    watched: tuple[str, list[tuple[float, int, int]]] | None = None,
) -> dict[str, Counter]:
    """Send the schedule; ``seen`` gets (sent at, model, status, latency ms) per request;
    ``watched`` = (model, samples): samples gets (elapsed s, batch cap, grant bytes) of that
    model from each progress line's status read."""
    codes: dict[str, Counter] = {m: Counter() for m in models}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(at: float, model: str, body: dict) -> None:
            await asyncio.sleep(max(0.0, t0 + at - loop.time()))
            sent = loop.time()
            try:
                r = await client.post(f"{url}/v1/models/{model}/infer", json=body)
                status = r.status_code
                if status == 504 and _shed(r):  # shed_late: too late for the SLO, answered at once
                    status = SHED
                codes[model][status] += 1
            except httpx.HTTPError as exc:
                codes[model][type(exc).__name__] += 1  # ConnectError, ReadTimeout, ...: no HTTP answer
                status = 0
            if seen is not None:
                seen.append((at, model, status, (loop.time() - sent) * 1000.0))

        async def progress() -> None:
            while loop.time() - t0 < total_s + 1:
                await asyncio.sleep(3.0)
                try:
                    st = (await client.get(f"{url}/v1/status", timeout=10)).json()
                except Exception:  # noqa: BLE001
                    continue
                el = loop.time() - t0
                if watched is not None and watched[0] in st["models"]:
                    w = st["models"][watched[0]]
                    watched[1].append((el, int(w["max_batch_size"]), int(w["grant_bytes"])))
                parts = []
                for name, m in st["models"].items():
                    p95 = "-" if m["p95_ms"] is None else f"{m['p95_ms']:.0f}ms"
                    parts.append(
                        f"{name}: cap {m['max_batch_size']} grant {format_size(m['grant_bytes'])} "
                        f"q {m['queue_depth']:.0f} {m['arrival_rate_rps']:.0f}rps p95 {p95}"
                    )
                console.print(f"[dim]{el:5.1f}s[/] " + " | ".join(parts), highlight=False)

        tasks = [asyncio.create_task(one(at, m, b)) for at, m, b in sched]
        prog = asyncio.create_task(progress())
        await asyncio.gather(*tasks)
        prog.cancel()
    return codes


def main() -> int:
    args = _parse_args()
    started = time.time()
    cfg, text = _demo_config(args.config)
    if args.burst not in cfg.models:
        console.print(f"[red]--burst {args.burst}: not a model of {args.config} ({', '.join(cfg.models)})[/]")
        return 2
    console.rule("[bold]1. gpubroker up")
    try:
        state = up_with_progress(cfg, text, args.config, UpOptions(num_cpus=2))
    except Exception as exc:  # noqa: BLE001
        console.print(f"[red]up failed: {exc}[/]")
        _down()
        return 1
    try:
        lending = _lending_arm(state["http_url"], cfg, args)
    finally:
        console.rule("[bold]4. gpubroker down")
        _down()
    code = lending.code
    if code == 0 and not args.no_compare:
        arms = {"broker (lending)": lending.line}
        fixed = _fixed_split_arm(text, args, lending.load)
        if fixed is None:
            code = 1  # the demo's comparison did not run: not a success
        else:
            arms["fixed split"] = fixed
        console.rule(f"[bold]{args.burst} during its burst: lending against a fixed split")
        for arm, line in arms.items():
            console.print(f"  {arm:17s} {line}", highlight=False)
    console.print(f"demo finished in {time.time() - started:.0f}s")
    return code


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--burst", default="prof", help="model that gets the burst")
    ap.add_argument("--warm-s", type=float, default=10.0)
    ap.add_argument("--burst-s", type=float, default=30.0)
    ap.add_argument("--cool-s", type=float, default=20.0)
    ap.add_argument("--base-rps", type=float, default=1.5, help="requests/s per model outside the burst (4 items each)")
    ap.add_argument(
        "--burst-rps",
        type=float,
        default=None,
        help="requests/s on the burst model (--burst-items each); default: BURST_OVER_BASE x what the batch its "
        "base quota holds serves, measured on this machine before the load",
    )
    ap.add_argument("--burst-items", type=int, default=16, help="items per request to the burst model (others: 4)")
    ap.add_argument("--no-compare", action="store_true", help="skip the fixed-split run of the same burst")
    return ap.parse_args()


def _demo_config(path: str) -> tuple[FleetConfig, str]:
    """The demo's config and its text, on a free HTTP port when its own is taken."""
    text = Path(path).read_text(encoding="utf-8")
    cfg = parse_config_text(text, path)
    if not port_free(cfg.broker.http_port, cfg.broker.http_host):
        port = free_port()
        console.print(f"port {cfg.broker.http_port} is taken: using {port}")
        text = re.sub(r"(?m)^(\s*http_port:\s*)\d+", rf"\g<1>{port}", text)
        cfg = parse_config_text(text, path)
    return cfg, text


@dataclass(frozen=True)
class Load:
    """The open-loop load, drawn before the run; both arms get the same."""

    sched: list[tuple[float, str, dict]]  # (time, model, body), sorted
    total_s: float
    models: list[str]


@dataclass(frozen=True)
class LendingRun:
    """The broker arm: its load, its burst line, and the demo's exit code so far."""

    load: Load
    line: str
    code: int


def _draw_load(url: str, cfg: FleetConfig, args: argparse.Namespace) -> Load:
    """Warm, burst and cool-down phases; without --burst-rps the burst rate is timed here first."""
    if args.burst_rps is None:
        args.burst_rps = calibrated_burst_rps(url, cfg, args.burst, args.burst_items)
    phases = [
        ("warm", args.warm_s, args.base_rps, args.base_rps),
        ("burst", args.burst_s, args.base_rps / 2, args.burst_rps),
        ("cool-down", args.cool_s, args.base_rps / 2, 0.0),
    ]
    models = list(cfg.models)
    sched = build_schedule(models, args.burst, example_inputs(cfg), phases, burst_items=args.burst_items)
    return Load(sched, sum(p[1] for p in phases), models)


def _lending_arm(url: str, cfg: FleetConfig, args: argparse.Namespace) -> LendingRun:
    """Steps 2 and 3: the load on the fleet as configured (lending on), then its status and decisions."""
    load = _draw_load(url, cfg, args)
    since = httpx.get(f"{url}/v1/status", timeout=30).json()["decision_seq"]
    console.rule(
        f"[bold]2. open-loop load: {len(load.sched)} requests over {load.total_s:.0f}s "
        f"(warm {args.warm_s:.0f}s, burst on {args.burst} {args.burst_s:.0f}s, cool-down {args.cool_s:.0f}s)"
    )
    seen: list[tuple[float, str, int, float]] = []
    watched: list[tuple[float, int, int]] = []
    codes = asyncio.run(run_load(url, load.sched, load.total_s, load.models, seen, (args.burst, watched)))
    st = httpx.get(f"{url}/v1/status", timeout=30).json()
    line = burst_line(seen, args, cfg, st, watched)
    for name, c in codes.items():
        console.print(f"  {name}: " + ", ".join(f"{k}: {v}" for k, v in sorted(c.items(), key=str)), highlight=False)
    time.sleep(2.0)
    _show_status_and_decisions(url, since, args.burst)
    bad = sum(v for c in codes.values() for k, v in c.items() if k not in (200, 503, SHED))
    if bad:
        console.print(f"[red]{bad} requests failed[/]")
    return LendingRun(load, line, 1 if bad else 0)


def _show_status_and_decisions(url: str, since: int, burst: str) -> None:
    """The status table, then the decisions since ``since``: the burst model's batch caps, the quota moves."""
    console.rule("[bold]3. gpubroker status")
    st = httpx.get(f"{url}/v1/status", timeout=30).json()
    console.print(status_table(st))
    decisions = httpx.get(f"{url}/v1/decisions", params={"since_seq": since}, timeout=30).json()
    moves = [d for d in decisions if d["kind"] == "move"]
    grants = [d for d in decisions if d["kind"] == "settings" and d["old"]["grant_bytes"] != d["new"]["grant_bytes"]]
    caps = [
        d
        for d in decisions
        if d["kind"] == "settings" and d["model"] == burst and d["old"]["max_batch_size"] != d["new"]["max_batch_size"]
    ]
    console.rule(f"[bold]gpubroker decisions: batch cap of {burst} ({len(caps)} changes)")
    for d in caps[:12] + (caps[-6:] if len(caps) > 18 else caps[12:]):
        console.print(describe_decision(d), highlight=False, markup=False)
    console.rule(f"[bold]gpubroker decisions: quota ({len(moves)} moves, {len(grants)} grant changes)")
    for d in sorted(moves + grants, key=lambda d: d["seq"]):
        console.print(describe_decision(d), highlight=False, markup=False)
    if not moves:
        calib = ", ".join(
            f"{n}: used {format_size(m['used_bytes'])} of {format_size(m['grant_bytes'])}"
            for n, m in st["models"].items()
        )
        console.print(
            f"[yellow]no quota moved:[/] every model's calibrated need at its batch cap fit its base "
            f"({calib}); quota moves when a busy model's wanted batch needs more than its grant."
        )


def _fixed_split_arm(text: str, args: argparse.Namespace, load: Load) -> str | None:
    """Step 5: the same load on a fixed split (quotas pinned at base); its burst line, None when it failed."""
    console.rule("[bold]5. the same burst on a fixed split (quotas pinned at base: nothing lends)")
    fixed_text = fixed_split(text)
    fixed_cfg = parse_config_text(fixed_text, args.config + " (fixed split)")
    try:
        state = up_with_progress(fixed_cfg, fixed_text, args.config, UpOptions(num_cpus=2))
        seen: list[tuple[float, str, int, float]] = []
        watched: list[tuple[float, int, int]] = []
        asyncio.run(run_load(state["http_url"], load.sched, load.total_s, load.models, seen, (args.burst, watched)))
        st = httpx.get(f"{state['http_url']}/v1/status", timeout=30).json()
        return burst_line(seen, args, fixed_cfg, st, watched)
    except Exception as exc:  # noqa: BLE001
        console.print(f"[red]fixed-split run failed: {exc}[/]")
        return None
    finally:
        _down()


BURST_OVER_BASE = 1.6  # the burst's items/s over what the burst model's base batch serves


def base_batch(spec) -> int:  # noqa: ANN001 - a ModelSpec
    """Items the model's base quota holds as one batch, by the broker's memory model."""
    from gpubroker.broker.control.memory_model import MemoryModel

    opts = spec.options
    mem = MemoryModel(int(opts.get("weights_bytes", 0) or 0), float(opts.get("bytes_per_item", 0) or 0))
    cap = mem.cap_for(spec.quota.base)
    return max(1, spec.batch.initial_cap if cap is None else cap)


def calibrated_burst_rps(url: str, cfg, model: str, items: int, probes: int = 5) -> float:  # noqa: ANN001
    """Requests/s for the burst: BURST_OVER_BASE x the items/s that back-to-back batches of the
    model's base batch serve, timed here (median of ``probes`` requests of that many items, one
    at a time, through HTTP), so the burst outruns the fixed split and needs borrowed memory
    on a fast machine and a slow one alike."""
    b = base_batch(cfg.models[model])
    b, times = _time_batches(url, model, example_inputs(cfg)[model], b, probes)
    batch_s = sorted(times)[len(times) // 2]
    rps = BURST_OVER_BASE * b / batch_s / items
    console.print(
        f"{model}: a batch of {b} (what its base holds by the config's memory figures) takes {batch_s * 1000:.0f} ms "
        f"here, {b / batch_s:.0f} items/s; "
        f"burst {rps:.1f} req/s x {items} items = {BURST_OVER_BASE:g}x that",
        highlight=False,
    )
    return rps


def _time_batches(url: str, model: str, item, b: int, probes: int) -> tuple[int, list[float]]:  # noqa: ANN001
    """``probes`` timings of one request of ``b`` items; a batch the replica refuses as too big
    for its cap right now (shed 504, 503) halves ``b`` and starts over, so the demo calibrates on
    what the model serves (the broker may hold its memory cap under the config's figures)."""
    times: list[float] = []
    with httpx.Client(timeout=30.0) as c:
        for _ in range(probes * 6):
            t = time.perf_counter()
            r = c.post(f"{url}/v1/models/{model}/infer", json={"inputs": [item] * b})
            if r.status_code == 200:
                times.append(time.perf_counter() - t)
                if len(times) == probes:
                    return b, times
            elif r.status_code in (503, 504) and b > 1:
                b, times = max(1, b // 2), []
                time.sleep(0.2)
            else:
                r.raise_for_status()
    raise RuntimeError(f"{model}: no batch of {b} item(s) answered 200 in {probes * 6} tries; see `gpubroker status`")


SHED = "504 shed"  # a 504 with "shed": true (shed_late): an explicit answer, not a failure


def _shed(r) -> bool:  # noqa: ANN001 - an httpx.Response
    try:
        return bool(r.json().get("shed"))
    except ValueError:
        return False


def fixed_split(text: str) -> str:
    """The same fleet with every quota pinned at its base (min = base = max): nothing lends."""
    import yaml

    data = yaml.safe_load(text)
    for spec in data["models"].values():
        q = spec["quota"]
        q["min"] = q["max"] = q["base"]
    return yaml.safe_dump(data, sort_keys=False)


def burst_line(
    seen: list[tuple[float, str, int, float]],
    args: argparse.Namespace,
    cfg,  # noqa: ANN001 - a FleetConfig
    status: dict,
    watched: list[tuple[float, int, int]],
) -> str:
    """Attainment within the SLO, P95 and out-of-memory answers of the burst model in its burst,
    and the batch caps and grants it ran at then (the status reads of the progress lines)."""
    start, end = args.warm_s, args.warm_s + args.burst_s
    rows = [(st, ms) for at, m, st, ms in seen if m == args.burst and start <= at < end]
    slo = cfg.models[args.burst].slo_p95_ms
    ok = sorted(ms for st, ms in rows if st == 200)
    met = sum(1 for ms in ok if ms <= slo)
    p95 = ok[min(len(ok) - 1, int(0.95 * len(ok)))] if ok else float("nan")
    oom = sum(1 for st, _ in rows if st == 507)
    shed = sum(1 for st, _ in rows if st == SHED)
    during = [(cap, grant) for el, cap, grant in watched if start <= el < end]
    ran = (
        f"caps {min(c for c, _ in during)}-{max(c for c, _ in during)}  grant up to {format_size(max(g for _, g in during))}"
        if during
        else "caps -"
    )
    return (
        f"attainment {met / max(1, len(rows)):6.1%} (SLO {slo:.0f} ms)  P95 {p95:6.0f} ms (answered)  "
        f"shed {shed:3d}  OOM answers {oom}  "
        f"requests {len(rows)}  oom splits {status['models'][args.burst].get('oom_splits', 0)}  {ran}"
    )


def _down() -> None:
    try:
        down(address=None)
    except SystemExit:
        pass
    except Exception as exc:  # noqa: BLE001
        console.print(f"[red]down failed: {exc}[/]")


if __name__ == "__main__":
    sys.exit(main())
