"""Small helpers of the live scenarios: schedules, machine facts, the eager-batching model, spreads."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench import loadgen as lg


def poisson_schedule(
    model: str, rate: float, duration_s: float, seed: int, body: bytes = b'{"inputs": [{}]}'
) -> list[lg.Planned]:
    from gpubroker.sim import arrivals as arr

    return lg.plan(model, arr.poisson(rate, duration_s, seed), body)


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1),
    }


def eager_batch(rate_rps: float, batch: int, wait_ms: float) -> float:
    """Mean batch Ray 2.60's eager ``@serve.batch`` forms at a Poisson rate: the first request
    plus the arrivals of the wait timeout, at most ``batch`` (batches never grow while the
    replica is busy)."""
    return min(float(batch), 1.0 + rate_rps * wait_ms / 1000.0)


def eager_saturation(batch: int, wait_ms: float, a_ms: float, c_ms: float) -> float:
    """Model estimate of the highest rate a static (batch, wait) arm sustains under eager
    batching: the rate where utilisation rate * L(b) / b reaches 1 with b = eager_batch(rate).
    Only a starting point for the live measurement (``seed`` measures it)."""

    def util(r: float) -> float:
        b = eager_batch(r, batch, wait_ms)
        return r * (a_ms + c_ms * b) / 1000.0 / b

    lo, hi = 0.0, 1000.0 * batch / (a_ms + c_ms * batch)  # never beyond the lazy bound b/(a + c b)
    if util(hi) < 1.0:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if util(mid) < 1.0 else (lo, mid)
    return lo


def spread(values: Sequence[float]) -> dict[str, float]:
    v = [float(x) for x in values]
    return {"mean": float(np.mean(v)), "min": min(v), "max": max(v)} if v else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, body: dict | None = None, timeout_s: float = 10.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None


def wait_http(
    url: str, body: dict | None = None, timeout_s: float = 120.0, ok: Callable[[int, Any], bool] | None = None
) -> Any:
    """Poll ``url`` until it answers 200 (and ``ok``); returns the JSON answer."""
    deadline = time.time() + timeout_s
    last: Any = None
    while time.time() < deadline:
        try:
            code, doc = http_json(url, body, timeout_s=10)
            last = (code, doc)
            if code == 200 and (ok is None or ok(code, doc)):
                return doc
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = repr(exc)
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f}s; last answer: {str(last)[:300]}")


# ------------------------------------------------------------------------------ configs
