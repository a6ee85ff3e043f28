"""A window with no activity is folded without its passes (``ReportWindow._quiet_load``): the
loads it gives must be exactly the full fold's, through a busy spell, its ageing out, a replica
going silent, refusals at the ingress and idle reports that still carry memory and queue."""

from __future__ import annotations

import random

import pytest

import gpubroker.broker.control.window as window_module
from gpubroker.broker.control.window import Digest, ReportWindow
from gpubroker.broker.wire import StatsReport
from tests.unit.policy_builders import MONDAY_UTC, gpu, make_config


class _AlwaysActive(Digest):
    """A digest the window takes as active whatever it carries: the window always runs the full fold."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.active = True


def _reports(rng: random.Random, t: float, step: int) -> list[StatsReport]:
    out = []
    for rid in ("a-r0", "a-r1"):
        if rid == "a-r1" and 90 <= step < 140:
            continue  # a-r1 falls silent for a while, then comes back
        busy = step < 30 or 160 <= step < 170
        arrivals = rng.randint(1, 20) if busy else 0
        bt = tuple((float(rng.randint(1, 16)), rng.uniform(1, 30)) for _ in range(rng.randint(1, 3))) if busy else ()
        out.append(
            StatsReport(
                model="a",
                replica_id=rid,
                seq=step,
                now_s=t,
                interval_s=0.5,
                arrivals=arrivals,
                completions=arrivals,
                latency_ms=tuple(rng.uniform(1, 200) for _ in range(arrivals // 2)),
                batches=bt,
                batch_requests=tuple(int(b) for b, _ in bt),
                busy_s=rng.uniform(0, 0.4) if busy else 0.0,
                queue_depth=rng.randint(0, 3) if step % 7 == 0 else 0,  # an idle replica can still hold a queue
                mem_used_bytes=rng.randint(10**6, 10**8),
                mem_peak_bytes=rng.randint(10**6, 10**8),
                settings_version=1 + step // 50,
            )
        )
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quiet_fold_equals_the_full_fold(seed, monkeypatch):
    cfg = make_config(models={"a": {"control": {"window_s": 10.0}}})
    quiet, full = ReportWindow(cfg), ReportWindow(cfg)
    taken = []
    real = ReportWindow._quiet_load

    def counting(*args, **kwargs):
        taken.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ReportWindow, "_quiet_load", staticmethod(counting))
    rng = random.Random(seed)
    t = MONDAY_UTC
    for step in range(200):
        t += 0.5
        for r in _reports(rng, t, step):
            quiet.add(r, t)
            monkeypatch.setattr(window_module, "Digest", _AlwaysActive)
            full.add(r, t)
            monkeypatch.setattr(window_module, "Digest", Digest)
        if step in (120, 121):  # refusals at the ingress: the window is not quiet while they are in it
            quiet.add_rejections("a", 3, t)
            full.add_rejections("a", 3, t)
        if step % 2:
            mem = (10**6, 1000.0)
            a = quiet.snapshot(t, gpu(), {"a": mem}, {"a": 100.0}).models["a"]
            b = full.snapshot(t, gpu(), {"a": mem}, {"a": 100.0}).models["a"]
            assert a == b, step
    assert len(taken) > 20  # the quiet fold did run, and agreed each time
