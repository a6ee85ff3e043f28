"""``broker.control.object_memo.ObjectMemo``: an answer per (object, key), computed only on a miss."""

from __future__ import annotations

from broker.control.object_memo import MISS, ObjectMemo


class Section:  # a config section: equal sections are still different objects
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Section)

    __hash__ = None  # type: ignore[assignment]  # like a mutable config model


def test_an_answer_is_computed_once_per_object_and_key():
    memo: ObjectMemo[int] = ObjectMemo()
    calls: list[tuple[int, float]] = []

    def ask(obj: Section, key: float) -> int:
        found = memo.get(obj, key)
        if found is MISS:
            calls.append((id(obj), key))
            found = memo.put(obj, key, len(calls))
        return found

    a, b = Section(), Section()
    assert ask(a, 1.0) == 1 and ask(a, 1.0) == 1  # a hit: not computed again
    assert ask(a, 2.0) == 2  # a new time: computed
    assert ask(b, 2.0) == 3  # an equal but new object (a reloaded config): its own answer
    assert ask(a, 2.0) == 2  # still a's own answer: b's entry did not take its place
    assert len(calls) == 3


def test_the_memo_is_bounded():
    memo: ObjectMemo[int] = ObjectMemo(size=4)
    keep = [Section() for _ in range(10)]
    for i, obj in enumerate(keep):
        assert memo.get(obj, None) is MISS and memo.put(obj, None, i) == i
    assert len(memo._entries) <= 4
    assert memo.get(keep[-1], None) == 9 and memo.get(keep[0], None) is MISS  # the newest is kept
