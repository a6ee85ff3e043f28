"""Out of memory inside a batch: every item that fits is answered, in order; an item that cannot
run even alone fails alone (naming its need and the grant); the OOM's cost reaches the policy,
which lowers the memory ceiling below it at once."""

from __future__ import annotations

import pytest

from gpubroker.broker.control.memory_model import MemoryModel
from gpubroker.broker.control.types import ModelLoad
from gpubroker.broker.core import BrokerCore
from gpubroker.broker.wire import StatsReport
from gpubroker.deployments.models import EmulatedOOM
from gpubroker.deployments.replica.oom import (
    OOM_STATUS,
    BatchResult,
    HeldOverGrant,
    ItemOOM,
    ItemOutOfMemory,
    ItemPricing,
    attempted_bytes,
    run_items,
    split_retry,
)

MiB = 1024**2


def fake_predict(limit: int, calls: list, oversize: frozenset = frozenset()):
    """A batch over ``limit`` items, or holding an oversize item, runs out of memory."""

    def run(items):
        calls.append(len(items))
        if len(items) > limit or oversize & set(items):
            raise EmulatedOOM(f"{len(items)} items > {limit}")
        return [item * 10 for item in items]

    return run


@pytest.mark.parametrize("n", [1, 3, 4, 7, 16, 33])
def test_split_retry_returns_every_result_in_order(n):
    calls: list[int] = []
    splits: list[int] = []
    out = split_retry(fake_predict(3, calls), list(range(n)), on_split=splits.append)
    assert out == [i * 10 for i in range(n)]
    assert sum(size for size in calls if size <= 3) == n  # each item ran once, in a batch that fit
    assert sorted(splits) == sorted(size for size in calls if size > 3)  # every OOM batch was split
    assert (len(splits) > 0) == (n > 3)


def test_split_halves_recursively():
    calls: list[int] = []
    split_retry(fake_predict(3, calls), list(range(8)))
    assert calls == [8, 4, 2, 2, 4, 2, 2]


def test_one_oversize_item_fails_alone_and_the_rest_succeed():
    calls: list[int] = []
    released = []
    result = run_items(
        fake_predict(3, calls, oversize=frozenset({5})),
        list(range(8)),
        pricing=ItemPricing(cost=lambda item: 1.0, need_bytes=lambda c: int(c * 300 * MiB), grant_bytes=256 * MiB),
        release=lambda: released.append(1),
    )
    assert isinstance(result, BatchResult)
    assert [o for i, o in enumerate(result.outputs) if i != 5] == [i * 10 for i in range(8) if i != 5]
    (failed,) = result.failed
    assert isinstance(result.outputs[5], ItemOOM) and failed.index == 5 and failed.cost == 1.0
    assert failed.need_bytes == 300 * MiB and failed.grant_bytes == 256 * MiB
    detail = failed.detail()
    assert "300.0 MiB" in detail and "256.0 MiB" in detail and "EmulatedOOM" in detail and "quota.max" in detail
    # 8 OOMs (5 is in it), [0..3] OOMs (4 > 3 items) and then fits in halves: only that batch was
    # too big as a batch; the ones holding item 5 are explained by it and do not count.
    assert result.oom_costs == (4.0,)
    assert result.splits == len(released) - 1  # every OOM released caches; the lone item's did not split
    assert OOM_STATUS == 507


def test_every_item_oversize_fails_each_alone_without_lowering_the_ceiling():
    result = run_items(fake_predict(0, []), [1, 2, 3], release=lambda: None)
    assert [o.index for o in result.failed] == [0, 1, 2]
    assert result.oom_costs == ()


def test_an_oom_that_leaves_the_process_over_its_grant_stops_the_model():
    """A model that keeps what it allocates: after its first OOM the process holds over its grant,
    so the model runs no more (its next allocation would come out of the runtime's slack): every
    item gets held()'s marker, no retry runs, and no batch cost is learnt from it."""
    calls: list[int] = []
    marker = HeldOverGrant("hog", 300 * MiB, 256 * MiB)
    asked = []

    def held():
        asked.append(1)
        return marker

    result = run_items(fake_predict(3, calls), list(range(8)), release=lambda: None, held=held)
    assert calls == [8] and asked == [1]
    assert result.outputs == (marker,) * 8 and result.oom_costs == () and result.failed == ()
    # held() says no: the usual split and retry
    result = run_items(fake_predict(3, calls), list(range(8)), release=lambda: None, held=lambda: None)
    assert list(result.outputs) == [i * 10 for i in range(8)]
    # the process goes over its grant part-way: what ran keeps its output, the rest gets the marker
    states = iter([None, marker])
    calls.clear()
    result = run_items(fake_predict(3, calls), list(range(8)), release=lambda: None, held=lambda: next(states))
    assert calls == [8, 4] and result.outputs == (marker,) * 8
    states = iter([None, None, marker])
    calls.clear()
    result = run_items(fake_predict(1, calls), list(range(4)), release=lambda: None, held=lambda: next(states))
    assert calls == [4, 2, 1, 1, 2] and result.outputs[:2] == (0, 10) and result.outputs[2:] == (marker, marker)
    assert "over its grant of 256.0 MiB" in marker.detail()


def test_oom_costs_count_batches_too_big_as_batches():
    result = run_items(
        fake_predict(3, []), list(range(8)), pricing=ItemPricing(cost=lambda item: 2.0), release=lambda: None
    )
    assert result.failed == () and sorted(result.oom_costs) == [8.0, 8.0, 16.0]  # 8 items, then two halves of 4


def test_split_retry_raises_the_lone_items_oom():
    with pytest.raises(ItemOutOfMemory, match="out of memory running this item alone") as err:
        split_retry(fake_predict(0, []), [1, 2])
    assert err.value.item.index == 0 and isinstance(err.value, MemoryError)


def test_wrong_output_count_is_an_error():
    with pytest.raises(RuntimeError, match="2 outputs for a batch of 3"):
        split_retry(lambda items: items[:2], [1, 2, 3])
    assert split_retry(lambda items: items, []) == []


def test_torch_cpu_allocation_failure_is_split_and_its_size_read():
    msg = (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 314572800 bytes. Error code 12 (Cannot allocate memory)"
    )

    def run(items):
        if len(items) > 1 or items[0] == "big":
            raise RuntimeError(msg)
        return items

    result = run_items(run, ["a", "big", "c"], release=lambda: None)
    assert result.outputs[0] == "a" and result.outputs[2] == "c"
    assert result.outputs[1].attempted_bytes == 314572800 and "300.0 MiB" in result.outputs[1].detail()
    assert attempted_bytes("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; ...)") == 2 * 1024**3
    assert attempted_bytes("no size here") is None


# ---------------------------------------------------------------------------------------------
# the policy learns: memory ceiling below the smallest cost that OOMed


def test_memory_model_ceiling_below_the_smallest_oom():
    load = ModelLoad(name="m", weights_bytes=10 * MiB, bytes_per_unit=1 * MiB, oom_costs=(12.0, 9.0))
    mm = MemoryModel.from_load(load)
    assert mm.oom_cost == 9.0
    assert mm.cap_for(1000 * MiB) == 8  # the grant alone would allow 890
    assert MemoryModel.from_load(ModelLoad(name="m", oom_costs=(5.0,))).cap_for(1) == 4  # uncalibrated too
    assert MemoryModel.from_load(ModelLoad(name="m")).cap_for(1) is None


CONFIG = """
broker: {name: oom, namespace: oom, control_interval_s: 1.0, report_interval_s: 0.5, metrics_port: 0}
gpu: {device: cpu, capacity: 2GiB, reserve_frac: 0.0}
models:
  m:
    model: profiled
    quota: {min: 64MiB, base: 1GiB, max: 1GiB}
    batch: {floor: 2, ceiling: 64, initial: 32}
    slo_p95_ms: 5000
    control: {window_s: 30, min_samples: 5}
"""


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000  # integer ticks (STYLE.md #4)

    def __call__(self) -> float:
        return float(self.t)


def _report(
    core: BrokerCore, clock: Clock, seq: int, cap: int, oom_costs: tuple[float, ...] = (), mem_bytes: int = 100 * MiB
) -> None:
    """A busy replica running full batches at ``cap``, a deep queue, latency far under the SLO,
    ``mem_bytes`` used at its peak."""
    core.report(
        StatsReport.from_dict(
            {
                "model": "m",
                "replica_id": "m-r0",
                "seq": seq,
                "now_s": clock(),
                "interval_s": 1.0,
                "arrivals": 2 * cap,
                "completions": 2 * cap,
                "latency_ms": [50.0] * (2 * cap),
                "batches": [[float(cap), 20.0], [float(cap), 20.0]],
                "batch_requests": [cap, cap],
                "busy_s": 0.9,
                "queue_depth": 4 * cap,
                "mem_used_bytes": mem_bytes,
                "mem_peak_bytes": mem_bytes,
                "oom_splits": len(oom_costs),
                "oom_costs": list(oom_costs),
                "settings_version": core.settings("m").version,
            }
        )
    )


def test_an_oom_lowers_the_cap_at_the_next_tick_and_it_stays_below():
    clock = Clock()
    core = BrokerCore(CONFIG, clock=clock)
    core.register("m", "m-r0", {"weights_bytes": 10 * MiB, "bytes_per_unit": 1 * MiB, "cost_unit": "requests"})
    caps = []
    for seq in range(4):  # busy and far under the SLO: the cap grows (or holds), never shrinks
        clock.t += 1
        _report(core, clock, seq, core.settings("m").max_batch_size)
        core.tick()
        caps.append(core.settings("m").max_batch_size)
    before = caps[-1]
    assert before >= 32
    clock.t += 1
    _report(core, clock, 4, before, oom_costs=(float(before),))  # the replica's batch at the cap ran out of memory
    core.tick()
    after = core.settings("m").max_batch_size
    assert after == before - 1  # at once, on the first tick that sees it
    for seq in range(5, 12):  # still busy, no further OOM: the ceiling holds while the OOM is in the window
        clock.t += 1
        _report(core, clock, seq, core.settings("m").max_batch_size)
        core.tick()
        assert core.settings("m").max_batch_size < before


def test_replica_helpers_answer_507_and_hold_the_local_ceiling():
    from gpubroker.deployments.replica.oom import OomCeiling, need_from_calibration, oom_error

    item = ItemOOM(0, 1.0, 300 * MiB, None, 256 * MiB, "EmulatedOOM: no")
    err = oom_error(2, item)
    assert err["status"] == 507 and err["field"] == "inputs[2]" and err["detail"].startswith("inputs[2]: out of memory")
    assert err["need_bytes"] == 300 * MiB and err["grant_bytes"] == 256 * MiB
    assert need_from_calibration({"weights_bytes": 10, "bytes_per_unit": 2.0})(3) == 16
    assert need_from_calibration({"weights_bytes": 10, "bytes_per_unit": 0})(3) is None
    now = [0]
    ceiling = OomCeiling(floor=2, hold_s=30, clock=lambda: now[0])
    assert ceiling.target(64) == 64
    assert ceiling.learn((16.0, 24.0)) == 15 and ceiling.target(64) == 15 and ceiling.target(8) == 8
    now[0] = 29
    assert ceiling.learn((20.0,)) == 15  # a later, larger OOM does not lift it
    now[0] = 58
    assert ceiling.target(64) == 15  # held 30 s from the latest OOM
    now[0] = 59
    assert ceiling.target(64) == 64
    assert OomCeiling(floor=4, hold_s=1, clock=lambda: 0).learn((2.0,)) == 4  # never below the floor
