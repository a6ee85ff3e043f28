"""Reliability of one replica, in-process (no Ray): overload, deadlines, bad input, memory squeeze.

``ModelReplica`` runs here exactly as Serve runs it (its async ``__init__``, Ray Serve's own
``@serve.batch`` batcher, the fast loop), with the broker link replaced by a ``CoreLink`` in
front of a real ``BrokerCore`` and, for the squeeze, the memory probe by a ``FakeProbe``. The
same scenarios run end to end on real Ray Serve in ``tests/integration/test_reliability.py``.
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from gpubroker.broker.core import BrokerCore
from gpubroker.deployments.replica.deployment import ModelReplica
from gpubroker.quotas.config import parse_config_text
from tests.chaos.harness import CoreLink, FakeProbe, FaultKind, Faults, rss_bytes
from tests.chaos.tally import Tally

MIB = 1024**2

CONFIG = """
broker: {name: rrel, namespace: rrel, control_interval_s: 0.5, report_interval_s: 0.25, metrics_port: 0}
gpu: {device: cpu, capacity: 1GiB, reserve_frac: 0.0, emergency_free_frac: 0.10}
models:
  slow:
    model: profiled
    options: {a_ms: 150, c_ms: 0, weights_bytes: 1048576, bytes_per_item: 0}
    quota: {min: 16MiB, base: 128MiB, max: 128MiB}
    batch: {floor: 1, ceiling: 1, initial: 1}
    wait: {min_ms: 0, max_ms: 5}
    max_queued: 8
    request_timeout_s: 0.5
    slo_p95_ms: 5000
  mlp:
    model: mlp
    quota: {min: 16MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 2, ceiling: 32, initial: 16}
    wait: {min_ms: 0, max_ms: 5}
    max_body_bytes: 4KiB
    slo_p95_ms: 5000
"""


class Rig:
    def __init__(self, core: BrokerCore, link: CoreLink, replica: ModelReplica):
        self.core, self.link, self.r = core, link, replica


async def make(name: str, monkeypatch, tmp_path) -> Rig:
    core = BrokerCore(CONFIG, capacity_bytes=1024 * MIB, checkpoint=tmp_path / f"{name}.json")
    link = CoreLink(core)
    monkeypatch.setattr(ModelReplica, "_broker_handle", lambda self: link)
    # Serve's batcher reads max_ongoing_requests from the replica context only to warn.
    from ray.serve import batching

    monkeypatch.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)
    r = ModelReplica.__new__(ModelReplica)
    await r.__init__(name, parse_config_text(CONFIG))
    assert r.registered
    return Rig(core, link, r)


async def close(rig: Rig) -> None:
    rig.r._report_task.cancel()
    try:
        await rig.r._report_task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001
        pass


def count_predicts(r: ModelReplica) -> list[int]:
    calls: list[int] = []
    real = r.adapter.predict

    def predict(items):
        calls.append(len(items))
        return real(items)

    r.adapter.predict = predict
    return calls


# ------------------------------------------------------------------------------ 4 overload
@pytest.mark.chaos
def test_overload_backpressure_counted_queued_complete(monkeypatch, tmp_path):
    async def main():
        rig = await make("slow", monkeypatch, tmp_path)
        try:
            calls = count_predicts(rig.r)
            # 8 fit the queue (max_queued); each takes ~150 ms alone, so some outlive 0.5 s:
            # give them room so this test is about back-pressure only.
            rig.r.spec = rig.r.spec.model_copy(update={"request_timeout_s": 5.0})
            # Admission must hold under concurrency: all 30 arrive before any is answered.
            results = await asyncio.gather(*(rig.r.infer([{}]) for _ in range(30)))
            codes = [x["status"] for x in results]
            rejected = [x for x in results if x["status"] == 503]
            # (the report loop may already have sent part of the delta: count at the broker)
            assert await rig.r.report_once()
            misses = rig.core.status()["models"]["slow"]["misses"]
            c = Tally.of(results, sent=30)
            faults = Faults("test_reliability_replica", "overload: 30 at once into max_queued 8", FaultKind.OVERLOAD)
            faults.check(
                "8 admitted and run, 22 refused with 503 + Retry-After, every refusal counted by the broker",
                codes.count(200) == 8
                and len(rejected) == 22
                and all("queue is full" in x["detail"] and x["retry_after_s"] >= 1 for x in rejected)
                and len(calls) == 8
                and misses == 22,
            )
            faults.record(
                c, figure=f"{codes.count(200)} x 200, {len(rejected)} x 503 + Retry-After; broker counted {misses}"
            )
            assert not faults.failures(), (codes, len(calls), misses)
            assert c.n_lost == 0, c.lost
        finally:
            await close(rig)

    asyncio.run(main())


# ------------------------------------------------------------------------------ 5 deadline
@pytest.mark.chaos
def test_request_past_deadline_gets_prompt_504(monkeypatch, tmp_path):
    async def main():
        rig = await make("slow", monkeypatch, tmp_path)
        try:
            # no background reports: the delta is read below, and a report at the deadline (0.5 s,
            # two report intervals) would move its timeouts to the broker first
            await close(rig)
            calls = count_predicts(rig.r)

            async def timed():
                t0 = time.perf_counter()
                out = await rig.r.infer([{}])
                return out, time.perf_counter() - t0

            results = await asyncio.gather(*(timed() for _ in range(6)))
            deadline = rig.r.spec.request_timeout_s
            late = [(out, s) for out, s in results if out["status"] == 504]
            ok = [(out, s) for out, s in results if out["status"] == 200]
            assert late and ok and len(late) + len(ok) == 6, [o["status"] for o, _ in results]
            over = max(s for _, s in late) - deadline
            await asyncio.sleep(1.0)  # the batcher drains; timed-out items must not run after their 504
            faults = Faults(
                "test_reliability_replica", "request queued past request_timeout_s 0.5 s", FaultKind.OVERLOAD
            )
            for out, s in late:
                faults.check(
                    f"504 {s * 1000:.0f} ms after arrival, naming request_timeout_s",
                    deadline - 0.01 <= s < deadline + 0.15 and "request_timeout_s" in out["detail"],
                )
            drained = rig.r.delta.timeouts == len(late) and rig.r.waiting == 0
            faults.record(
                Tally.of([out for out, _ in results], sent=6),
                ok=drained,
                figure=f"504 at most {over * 1000:.0f} ms after the deadline; model ran {sum(calls)} of 6 items",
            )
            assert not faults.failures(), faults.failures()
            assert drained, (rig.r.delta.timeouts, len(late), rig.r.waiting)
        finally:
            await close(rig)

    asyncio.run(main())


# ------------------------------------------------------------------------------ 7 bad input
BAD_INPUTS = [
    ({"x": [0.1] * 63}, "inputs[0].x"),  # wrong length
    ({"x": ["a"] * 64}, "inputs[0].x"),  # wrong dtype
    ({"x": [[0.1] * 64]}, "inputs[0].x"),  # wrong shape
    ({"y": [0.1] * 64}, "inputs[0]"),  # wrong field
    ({"x": None}, "inputs[0].x"),
    ("just a string", "inputs[0]"),
    ({"x": [float("nan")] * 64}, "inputs[0].x"),
]


@pytest.mark.chaos
def test_bad_requests_never_reach_model_and_memory_stays(monkeypatch, tmp_path):
    async def main():
        rig = await make("mlp", monkeypatch, tmp_path)
        try:
            await close(rig)  # no background reports: this test reads the replica's delta itself
            calls = count_predicts(rig.r)
            good = {"x": [0.1] * 64}
            tally = Tally()
            for _ in range(3):  # warm the allocator the same way bad input would
                await tally.acall(rig.r.infer([good]))
            n0 = len(calls)
            gc.collect()
            rss0 = rss_bytes(__import__("os").getpid())
            faults = Faults("test_reliability_replica", "bad requests (413/422) in-process", FaultKind.MALFORMED_INPUT)
            for _ in range(30):
                for item, field in BAD_INPUTS:
                    out = await tally.acall(rig.r.infer([item]))
                    faults.check(
                        f"{str(item)[:30]}: 422 naming {field}",
                        out["status"] == 422 and str(out.get("field", "")).startswith(field),
                    )
                out = await tally.acall(rig.r.infer([good] * 10, body_bytes=5000))  # over max_body_bytes 4KiB
                faults.check(
                    "body over max_body_bytes: 413", out["status"] == 413 and "max_body_bytes" in out["detail"]
                )
                out = await tally.acall(rig.r.infer([good, {"x": [1.0] * 3}]))  # one bad item refuses the whole request
                faults.check(
                    "one bad item of two: 422 naming inputs[1].x",
                    out["status"] == 422 and out["field"].startswith("inputs[1].x"),
                )
            gc.collect()
            rss1 = rss_bytes(__import__("os").getpid())
            grew = (rss1 - rss0) / MIB
            sent = len(faults.observed)
            untouched = len(calls) == n0 and rig.r.delta.arrivals == 3  # only the good ones were admitted
            faults.record(
                tally,  # the 3 good ones and every bad one
                ok=untouched and grew < 16,
                figure=f"{sent - len(faults.failures())}/{sent} refused, {len(calls) - n0} predict calls, RSS {grew:+.1f} MiB",
            )
            assert not faults.failures(), faults.failures()[:5]
            assert untouched, "a bad request reached the model"
            assert grew < 16, f"RSS grew {grew:.1f} MiB over {sent} bad requests"
        finally:
            await close(rig)

    asyncio.run(main())


# ------------------------------------------------------------------------------ 8 squeeze
@pytest.mark.chaos
def test_memory_squeeze_emergency_shrink_then_recovery(monkeypatch, tmp_path):
    async def main():
        rig = await make("mlp", monkeypatch, tmp_path)
        r = rig.r
        try:
            base = r.baseline_bytes
            grant = r._grant_per_replica(r.settings)
            probe = FakeProbe(1024 * MIB, base + 10 * MIB)
            r.probe = probe
            good = {"x": [0.1] * 64}
            tally = Tally()
            normal = r.settings.max_batch_size
            assert r.cap == normal == 16
            # headroom falls under emergency_free_frac (10%): 95% of the grant in use
            probe.process_bytes = base + int(0.95 * grant)
            out = await tally.acall(r.infer([good]))
            assert out["status"] == 200
            assert r.cap == 8 and r.delta.emergency_shrinks == 1, "no shrink within one batch"
            shrinks = [r.cap]
            for _ in range(6):
                out = await tally.acall(r.infer([good]))
                shrinks.append(r.cap)
                if out["status"] != 200:
                    break
            assert r.cap == r.spec.batch.floor
            # memory stays critical: admission pauses with an explicit retriable 503
            probe.process_bytes = base + int(0.99 * grant)
            codes = []
            for _ in range(3):
                codes.append((await tally.acall(r.infer([good])))["status"])
            assert r.paused and codes[-1] == 503, codes
            # the broker hears about it in the next report
            assert await r.report_once()
            rig.core.tick()
            # headroom returns: the broker re-admits, the fast loop widens step by step
            probe.process_bytes = base + 10 * MIB
            t0 = time.time()
            recovered = None
            statuses = []
            while time.time() - t0 < 15:
                await r.report_once()
                rig.core.tick()
                out = await tally.acall(r.infer([good]))
                statuses.append(out["status"])
                if out["status"] == 200 and r.cap >= r.settings.max_batch_size and not r.paused:
                    recovered = time.time() - t0
                    break
                await asyncio.sleep(0.1)
            faults = Faults("test_reliability_replica", "memory squeeze (free 5% < 10%) in-process", FaultKind.MEMORY)
            faults.check(
                "shrunk within one batch, paused with 503 at 99%, back to full cap once headroom returns",
                recovered is not None,
            )
            faults.record(
                tally,
                figure=f"cap 16 -> {' -> '.join(map(str, shrinks))} within one batch each, paused; "
                + (f"back to {r.cap} in {recovered:.1f}s" if recovered is not None else "NOT recovered in 15 s"),
            )
            assert recovered is not None, (r.cap, r.paused, r.settings, statuses[-5:])
        finally:
            await close(rig)

    asyncio.run(main())
