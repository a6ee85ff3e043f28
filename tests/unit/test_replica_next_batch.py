"""The next batch starts before a finished batch's results are sent (``gpubroker.deployments.replica.next_batch``).

In-process, Serve's real batcher, the ``profiled`` EMULATION (it sleeps a + c*b): a request runs
alone while ten more wait at the lazy gate; when its batch ends, the ten form the next batch. With
``START_NEXT_FIRST`` (the default) that batch has started (the gate counts it running) before the
first request's ``infer`` returns; a replica class that turns it off keeps Serve's order (results
first). The order is of event-loop steps, not of time: the bound on the wait is set out of reach.
"""

from __future__ import annotations

import asyncio
import time

from gpubroker.deployments.replica.deployment import ModelReplica
from tests.unit.test_replica_lazy_formation import CONFIG, _replica


class ResultsFirst(ModelReplica):
    START_NEXT_FIRST = False


async def _order(monkeypatch, tmp_path, cls: type) -> tuple[float, float, list[int], ModelReplica]:
    """(when the first request's infer returned, when the second batch started, batch sizes, replica)."""
    monkeypatch.setattr("tests.unit.test_replica_lazy_formation.ModelReplica", cls)
    r, sizes = await _replica(CONFIG.format(formation="lazy"), monkeypatch, tmp_path / f"{cls.__name__}.json")
    sizes.clear()
    r.next_start.wait_s = 60.0  # the order below must not depend on how loaded the machine is
    starts: list[float] = []
    real = r.gate.batch_started

    def batch_started() -> None:  # on the event loop, as the batch starts (before its predict)
        starts.append(time.perf_counter())
        real()

    r.gate.batch_started = batch_started

    async def first() -> float:
        out = await r.infer([{}])
        assert out["status"] == 200, out
        return time.perf_counter()

    t_first = asyncio.ensure_future(first())
    await asyncio.sleep(0.03)  # the first batch (one request) runs; these ten wait at the gate
    rest = [asyncio.ensure_future(r.infer([{}])) for _ in range(10)]
    done_first = await t_first
    out = await asyncio.gather(*rest)
    assert all(o["status"] == 200 for o in out)
    return done_first, starts[1], sizes, r


def test_the_next_batch_starts_before_the_results_go_out(monkeypatch, tmp_path):
    done_first, second_start, sizes, r = asyncio.run(_order(monkeypatch, tmp_path, ModelReplica))
    assert sizes == [1, 10], sizes
    assert second_start < done_first, (second_start, done_first)
    # Serve's batcher has one slot more than the gate, which still runs one batch at a time
    assert r.next_start.extra_slots == 1 and r.gate.max_concurrent_batches == 1


def test_turned_off_the_results_go_out_first(monkeypatch, tmp_path):
    done_first, second_start, sizes, r = asyncio.run(_order(monkeypatch, tmp_path, ResultsFirst))
    assert sizes == [1, 10], sizes
    assert r.next_start.extra_slots == 0
    assert done_first < second_start, (second_start, done_first)
