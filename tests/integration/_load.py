"""Open-loop HTTP load for the integration tests: arrival times drawn before the run. Given a
``Tally`` (``tests/chaos/tally.py``), every request is counted in it where it is sent and where
it ends, with its body (a chaos row's count); the status counter stays for the figures."""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter

import httpx

from tests.chaos.tally import Tally


def poisson_times(rate: float, duration_s: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(t)


async def _run(
    url: str, model: str, times: list[float], body: dict, codes: Counter, timeout_s: float, tally: Tally | None
) -> None:
    tally = tally if tally is not None else Tally()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - loop.time()))
            try:
                r = await tally.acall(client.post(f"{url}/v1/models/{model}/infer", json=body))
                codes[r.status_code] += 1
            except httpx.HTTPError:
                codes[0] += 1

        await asyncio.gather(*(one(at) for at in times))


def open_loop(
    url: str,
    model: str,
    rate: float,
    duration_s: float,
    body: dict,
    seed: int = 0,
    timeout_s: float = 30.0,
    tally: Tally | None = None,
) -> Counter:
    codes: Counter = Counter()
    asyncio.run(_run(url, model, poisson_times(rate, duration_s, seed), body, codes, timeout_s, tally))
    return codes


def open_loop_bg(*args, **kwargs) -> tuple[threading.Thread, Counter]:
    """Run ``open_loop`` in a thread; returns (thread, live status-code counter)."""
    codes: Counter = Counter()

    def target() -> None:
        codes.update(open_loop(*args, **kwargs))

    th = threading.Thread(target=target, daemon=True)
    th.start()
    return th, codes
