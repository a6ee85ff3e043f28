"""The replica's fast loop holds the forming batch open while one runs (in-process, no Ray).

Ray 2.60's ``@serve.batch`` closes a batch ``batch_wait_timeout_s`` after its first request even
while the replica is busy, so requests arriving during a long batch leave in many small
batches. ``ModelReplica._hold_open`` sets the wait to the running batch's predicted time; this
test counts batches with and without it on the real batcher and a ``profiled`` model
(EMULATION: it sleeps a + c*b).
"""

from __future__ import annotations

import asyncio

from broker.actor import BrokerCore
from deployments.replica import ModelReplica
from tests.chaos.harness import CoreLink
from tests.unit.test_reliability_replica import count_predicts

MIB = 1024**2

CONFIG = """
broker: {{name: rhold, namespace: rhold, control_interval_s: 5, report_interval_s: 5, metrics_port: 0, batch_formation: {formation}}}
gpu: {{device: cpu, capacity: 1GiB, reserve_frac: 0.0}}
models:
  prof:
    model: profiled
    options: {{a_ms: 120, c_ms: 2, weights_bytes: 1048576, bytes_per_item: 0}}
    quota: {{min: 16MiB, base: 128MiB, max: 128MiB}}
    batch: {{floor: 1, ceiling: 64, initial: 64}}
    wait: {{min_ms: 0, max_ms: 2, initial_ms: 1}}
    slo_p95_ms: 5000
"""


async def _run(formation: str, monkeypatch, tmp_path) -> list[int]:
    text = CONFIG.format(formation=formation)
    core = BrokerCore(text, capacity_bytes=1024 * MIB, checkpoint_path=tmp_path / f"{formation}.json")
    link = CoreLink(core)
    monkeypatch.setattr(ModelReplica, "_broker_handle", lambda self: link)
    from ray.serve import batching

    monkeypatch.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)
    r = ModelReplica.__new__(ModelReplica)
    await r.__init__("prof", text)
    r._report_task.cancel()
    sizes = count_predicts(r)
    for _ in range(3):  # a few batches of different sizes to fit L(b)
        await asyncio.gather(*(r.infer([{}]) for _ in range(1)))
        await asyncio.gather(*(r.infer([{}]) for _ in range(4)))
    sizes.clear()

    async def stream(n: int, gap_s: float) -> list[dict]:
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.ensure_future(r.infer([{}])))
            await asyncio.sleep(gap_s)
        return await asyncio.gather(*tasks)

    out = await stream(60, 0.01)  # 100 req/s against ~120 ms batches
    assert all(o["status"] == 200 for o in out)
    return sizes


def test_hold_open_turns_eager_batches_into_load_sized_ones(monkeypatch, tmp_path):
    eager = asyncio.run(_run("eager", monkeypatch, tmp_path))
    lazy = asyncio.run(_run("lazy", monkeypatch, tmp_path))
    assert sum(eager) == sum(lazy) == 60
    # eager, 1 ms wait: most requests arriving during a batch leave on their own
    assert len(eager) > 25, eager
    # held open: each batch gathers what arrived while the previous one ran (~12 requests)
    assert len(lazy) <= 12, lazy
    assert max(lazy) >= 8, lazy
