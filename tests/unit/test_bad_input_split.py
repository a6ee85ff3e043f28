"""A bad input fails alone: an exception from ``predict`` splits the batch (the path an
out-of-memory error takes, ``gpubroker.deployments.replica.oom.run_items``) until the failing items
are found; each gets its own error and nothing else, every other item its output; the work is
bounded by 2·k·⌈log2 n⌉ extra calls for k bad items in a batch of n.

The fake model fails a batch holding a bad item with a message that quotes EVERY input of the
batch, as a careless model might: an error shown to a client must then come from a lone run.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpubroker.deployments.models import EmulatedOOM, InputError, OutputCountError
from gpubroker.deployments.replica.oom import (
    ERROR_TEXT_CHARS,
    ItemError,
    ItemOOM,
    item_error,
    oom_error,
    run_items,
)


def picky(calls: list[int], oom_over: int = 1_000_000):
    """Items are strings; "crash-*" raises ValueError, "refuse-*" InputError, "huge-*" runs out of
    memory (as does any batch over ``oom_over`` items); the message names every item of the batch."""

    def run(items: list[str]) -> list[str]:
        calls.append(len(items))
        everyone = ", ".join(items)
        if len(items) > oom_over or any(i.startswith("huge") for i in items):
            raise EmulatedOOM(f"out of memory on {everyone}")
        if any(i.startswith("refuse") for i in items):
            raise InputError("text", f"refused: {everyone}")
        if any(i.startswith("crash") for i in items):
            raise ValueError(f"cannot read {everyone}")
        return [f"ok:{i}" for i in items]

    return run


def _markers(n: int, bad: dict[int, str]) -> list[str]:
    """Markers no other marker contains: "good03", "crash05" (never "crash1" inside "crash12")."""
    return [f"{bad[i]}{i:02d}" if i in bad else f"good{i:02d}" for i in range(n)]


def test_one_bad_item_fails_alone_with_its_own_error_and_the_rest_is_answered():
    calls: list[int] = []
    items = _markers(8, {5: "crash"})
    result = run_items(picky(calls), items, release=lambda: None)
    assert [o for i, o in enumerate(result.outputs) if i != 5] == [f"ok:good{i:02d}" for i in range(8) if i != 5]
    (err,) = result.errors
    assert result.outputs[5] is err and err == ItemError(5, "ValueError", "cannot read crash05", None)
    assert err.status == 500 and result.failed == () and result.oom_costs == ()
    # 8 fails; [0..3] runs; [4..7] fails; [4, 5] fails; 4 runs; 5 fails alone; [6, 7] runs
    assert calls == [8, 4, 4, 2, 1, 1, 2]
    assert result.error_splits == 3 and result.splits == 0  # no OOM split counted


def test_a_good_batch_costs_one_call_and_no_split():
    calls: list[int] = []
    result = run_items(picky(calls), _markers(16, {}), release=lambda: None)
    assert calls == [16] and result.errors == () and result.error_splits == 0


def test_input_error_from_predict_is_a_422_naming_the_item_and_its_field():
    result = run_items(picky([]), _markers(4, {2: "refuse"}), release=lambda: None)
    (err,) = result.errors
    assert err.index == 2 and err.field == "text" and err.status == 422
    answer = item_error(err.index, err, "picky")
    assert answer == {"status": 422, "detail": "inputs[2].text: refused: refuse02", "field": "inputs[2].text"}
    whole = item_error(0, ItemError(0, "InputError", "expected an object", "body"), "picky")
    assert whole["field"] == "inputs[0]" and whole["detail"] == "inputs[0]: expected an object"


def test_another_exception_is_a_500_naming_the_model_the_item_and_its_own_error_only():
    result = run_items(picky([]), _markers(6, {1: "crash", 4: "crash"}), release=lambda: None)
    answers = {e.index: item_error(e.index, e, "picky") for e in result.errors}
    assert sorted(answers) == [1, 4]
    assert answers[1] == {
        "status": 500,
        "detail": "model 'picky' failed on inputs[1]: ValueError: cannot read crash01",
        "field": "inputs[1]",
    }
    assert "crash01" not in answers[4]["detail"] and "good" not in str(answers)


def test_out_of_memory_and_errors_in_one_batch_each_fail_alone_and_only_the_oom_lowers_nothing():
    result = run_items(picky([]), _markers(8, {0: "huge", 3: "refuse", 6: "crash"}), release=lambda: None)
    kinds = {i: type(o).__name__ for i, o in enumerate(result.outputs) if not isinstance(o, str)}
    assert kinds == {0: "ItemOOM", 3: "ItemError", 6: "ItemError"}
    assert isinstance(result.outputs[0], ItemOOM) and "huge00" in oom_error(0, result.outputs[0])["detail"]
    assert "refuse" not in oom_error(0, result.outputs[0])["detail"]  # its own OOM text, from its lone run
    assert result.oom_costs == ()  # every OOM here is explained by the oversize item
    assert [o for o in result.outputs if isinstance(o, str)] == [f"ok:good{i:02d}" for i in (1, 2, 4, 5, 7)]


def test_a_batch_too_big_then_a_bad_item_in_a_half():
    calls: list[int] = []
    result = run_items(picky(calls, oom_over=4), _markers(8, {6: "crash"}), release=lambda: None)
    assert [e.index for e in result.errors] == [6] and result.failed == ()
    assert result.splits == 1 and result.oom_costs == ()  # a half failed: the OOM is not learnt as too big
    assert [o for i, o in enumerate(result.outputs) if i != 6] == [f"ok:good{i:02d}" for i in range(8) if i != 6]


def test_a_long_error_text_is_cut():
    def run(items):
        raise RuntimeError("x" * 10_000)

    (err,) = run_items(run, ["a"], release=lambda: None).errors
    assert len(err.message) == ERROR_TEXT_CHARS and err.kind == "RuntimeError"


def test_a_wrong_output_count_is_the_models_bug_not_split():
    calls: list[int] = []

    def run(items):
        calls.append(len(items))
        return items[:1]

    with pytest.raises(OutputCountError, match="1 outputs for a batch of 4"):
        run_items(run, [1, 2, 3, 4])
    assert calls == [4]

    def wrapped(items):  # a user model's wrapper raises it from inside predict: not split either
        calls.append(len(items))
        raise OutputCountError(f"predict returned 0 outputs for {len(items)} inputs")

    calls.clear()
    with pytest.raises(OutputCountError):
        run_items(wrapped, [1, 2, 3, 4])
    assert calls == [4]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=64),
    bad=st.dictionaries(st.integers(min_value=0, max_value=63), st.sampled_from(["crash", "refuse"]), max_size=8),
)
def test_every_item_gets_its_own_answer_within_the_bound(n, bad):
    bad = {i: kind for i, kind in bad.items() if i < n}
    calls: list[int] = []
    items = _markers(n, bad)
    result = run_items(picky(calls), items, release=lambda: None)
    assert len(result.outputs) == n
    for i, out in enumerate(result.outputs):
        if i not in bad:
            assert out == f"ok:{items[i]}"
            continue
        assert isinstance(out, ItemError) and out.index == i
        assert (out.status == 422) == (bad[i] == "refuse")
        text = item_error(i, out, "picky")["detail"]
        assert items[i] in text and all(other not in text for other in items if other != items[i])
    k = len(bad)
    extra = len(calls) - 1
    assert extra <= 2 * k * math.ceil(math.log2(n)) if n > 1 else extra == 0
    assert extra <= max(0, 2 * n - 2)
