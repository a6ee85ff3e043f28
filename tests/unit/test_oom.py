"""OOM split-retry: every request answered, in order, when a batch runs out of memory."""

from __future__ import annotations

import pytest

from deployments.models import EmulatedOOM, load_adapter
from deployments.oom import split_retry


def fake_predict(limit: int, calls: list):
    def run(items):
        calls.append(len(items))
        if len(items) > limit:
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


def test_single_item_oom_reraises():
    with pytest.raises(EmulatedOOM):
        split_retry(fake_predict(0, []), [1, 2])


def test_other_errors_are_not_split():
    calls = []

    def run(items):
        calls.append(len(items))
        raise ValueError("bad input")

    with pytest.raises(ValueError):
        split_retry(run, [1, 2, 3, 4])
    assert calls == [4]


def test_wrong_output_count_is_an_error():
    with pytest.raises(RuntimeError, match="2 outputs for a batch of 3"):
        split_retry(lambda items: items[:2], [1, 2, 3])
    assert split_retry(lambda items: items, []) == []


def test_split_retry_with_profiled_model_over_its_limit():
    adapter = load_adapter("profiled", {"a_ms": 0, "c_ms": 0, "weights_bytes": 1000, "bytes_per_item": 100})
    adapter.set_memory_limit(1000 + 3 * 100)
    items = [adapter.validate({}) for _ in range(10)]
    with pytest.raises(EmulatedOOM):
        adapter.predict(items)
    out = split_retry(adapter.predict, items)
    assert len(out) == 10 and all(o["ok"] and o["batch"] <= 3 for o in out)
