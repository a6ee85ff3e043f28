"""Lazy batch formation in the replica (in-process, no Ray cluster; Serve's real batcher).

Ray 2.60's ``@serve.batch`` closes a batch ``batch_wait_timeout_s`` after its first request and
queues it for a slot, then forms the next one at once, busy or not: requests arriving during a
long batch leave in many small batches, and a backlog never merges into a bigger one.
``ModelReplica._admit_to_batcher`` holds arrivals at a gate while a batch runs and lets them in
together when it finishes. These tests count batches with and without it on a ``profiled`` model
(EMULATION: it sleeps a + c*b).
"""

from __future__ import annotations

import asyncio

from gpubroker.broker.core import BrokerCore
from gpubroker.deployments.replica.deployment import ModelReplica
from gpubroker.quotas.config import parse_config_text
from tests.chaos.harness import CoreLink
from tests.unit.test_reliability_replica import count_predicts

MIB = 1024**2

CONFIG = """
broker: {{name: rlazy, namespace: rlazy, control_interval_s: 5, report_interval_s: 5, metrics_port: 0, batch_formation: {formation}}}
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


async def _replica(text: str, monkeypatch, ckpt) -> tuple[ModelReplica, list[int]]:
    """A replica on Serve's real batcher beside an in-process broker core; the sizes of the
    batches it runs from now on."""
    core = BrokerCore(text, capacity_bytes=1024 * MIB, checkpoint=ckpt)
    link = CoreLink(core)
    monkeypatch.setattr(ModelReplica, "_broker_handle", lambda self: link)
    from ray.serve import batching

    monkeypatch.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)
    r = ModelReplica.__new__(ModelReplica)
    await r.__init__("prof", parse_config_text(text))
    r._report_task.cancel()
    return r, count_predicts(r)


async def _run(formation: str, monkeypatch, tmp_path) -> list[int]:
    text = CONFIG.format(formation=formation)
    r, sizes = await _replica(text, monkeypatch, tmp_path / f"{formation}.json")
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


def test_lazy_formation_turns_eager_batches_into_load_sized_ones(monkeypatch, tmp_path):
    eager = asyncio.run(_run("eager", monkeypatch, tmp_path))
    lazy = asyncio.run(_run("lazy", monkeypatch, tmp_path))
    assert sum(eager) == sum(lazy) == 60
    # eager, 1 ms wait: most requests arriving during a batch leave on their own
    assert len(eager) > 25, eager
    # lazy: each batch gathers what arrived while the previous one ran (~12 requests at
    # 100/s against ~120 ms batches); only the first leaves alone
    assert len(lazy) <= 8, lazy
    assert max(lazy) >= 10, lazy


def test_a_backlog_leaves_in_one_batch_up_to_the_cap(monkeypatch, tmp_path):
    """40 requests arriving 2 ms apart while a batch runs: lazy formation runs them as one batch
    right after it; eager formation (1 ms wait) queues ~40 batches of one, each paying the fixed
    cost, and they never merge. The lazy replica's first batch runs 300 ms (a_ms 300), so the 40
    arrivals (80 ms at 2 ms apart, ~200 ms when a loaded machine stretches each sleep) all land
    while it runs; eager keeps 120 ms so its 40 batches of one stay a few seconds."""

    async def burst(formation: str) -> list[int]:
        text = CONFIG.format(formation=formation)
        if formation == "lazy":
            text = text.replace("a_ms: 120", "a_ms: 300")
        r, sizes = await _replica(text, monkeypatch, tmp_path / f"b-{formation}.json")
        first = asyncio.ensure_future(r.infer([{}]))
        await asyncio.sleep(0.03)  # the first batch is running
        rest = []
        for _ in range(40):
            rest.append(asyncio.ensure_future(r.infer([{}])))
            await asyncio.sleep(0.002)
        out = await asyncio.gather(first, *rest)
        assert all(o["status"] == 200 for o in out)
        return sizes

    eager = asyncio.run(burst("eager"))
    lazy = asyncio.run(burst("lazy"))
    assert sum(lazy) == sum(eager) == 41
    assert len(lazy) <= 3 and max(lazy) >= 35, lazy  # a straggler may miss the gate's opening
    assert len(eager) > 20, eager


def test_a_backlog_cut_by_a_small_cap_merges_when_the_cap_grows(monkeypatch, tmp_path):
    """The gate lets in one cap's worth per free slot. With cap 2, 30 waiting requests enter two
    at a time; when the broker raises the cap to 64 during the next batch, the other 28 leave
    together. (Letting all 30 in at once would have cut them into 15 batches of 2 queued for the
    slot, and no later cap could merge them: the backlog a slow start leaves would persist.)"""

    async def run() -> list[int]:
        text = CONFIG.format(formation="lazy").replace("initial: 64", "initial: 2")
        r, sizes = await _replica(text, monkeypatch, tmp_path / "cap.json")
        assert r.cap == 2
        first = asyncio.ensure_future(r.infer([{}]))
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(r.infer([{}])) for _ in range(30)]
        await asyncio.sleep(0.18)  # batch 1 (1) has ended, batch 2 (the cap, 2) runs
        r.cap = 64  # what _apply does with the broker's new cap
        r._batch.set_max_batch_size(64)
        r._pump()
        out = await asyncio.gather(first, *rest)
        assert all(o["status"] == 200 for o in out)
        return sizes

    sizes = asyncio.run(run())
    assert sizes == [1, 2, 28], sizes


def test_a_request_that_times_out_inside_the_batcher_does_not_jam_the_gate(monkeypatch, tmp_path):
    """Serve drops a cancelled request from its batch without calling the model, so the gate
    must count it out itself: a request let in (the broker's 400 ms wait is forming its batch)
    that times out at 150 ms must not keep the next request out."""

    async def run() -> tuple[dict, dict, list[int]]:
        text = (
            CONFIG.format(formation="lazy")
            .replace(
                "wait: {{min_ms: 0, max_ms: 2, initial_ms: 1}}".replace("{{", "{").replace("}}", "}"),
                "wait: {min_ms: 0, max_ms: 400, initial_ms: 400}",
            )
            .replace("slo_p95_ms: 5000", "slo_p95_ms: 5000\n    request_timeout_s: 0.15")
        )
        assert "initial_ms: 400" in text and "request_timeout_s: 0.15" in text
        r, sizes = await _replica(text, monkeypatch, tmp_path / "to.json")
        first = await r.infer([{}])  # let in; its batch waits 400 ms to form; it times out at 150 ms
        await asyncio.sleep(0.4)  # Serve's batcher drops it: no batch runs
        assert r._released == 0  # counted out when it was cancelled
        r.spec = r.spec.model_copy(update={"request_timeout_s": 5.0})
        second = await r.infer([{}])
        return first, second, sizes

    first, second, sizes = asyncio.run(run())
    assert first["status"] == 504, first
    assert second["status"] == 200, second
    assert sizes == [1], sizes
