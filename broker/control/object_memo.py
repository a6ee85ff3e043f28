"""Answers kept per config object, for what a tick asks of an unchanged config again and again
(``broker.control.profiles.active_profile``, ``broker.control.lending``'s model orders): a cache that changes no
answer. Keyed on the object's identity, which is held here so its id is not reused; a reloaded
config is a new object, so an answer never outlives its config. Bounded: cleared when full."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
MISS: Any = object()  # ``ObjectMemo.get``'s answer when nothing is kept for (object, key)


class ObjectMemo(Generic[T]):
    """Per object, the last (key, answer). ``get`` is on the tick's path: no closure to build on a hit."""

    __slots__ = ("_entries", "_size")

    def __init__(self, size: int = 64) -> None:
        self._entries: dict[int, tuple[Any, Hashable, T]] = {}
        self._size = size

    def get(self, obj: Any, key: Hashable) -> T:
        """The answer kept for ``obj`` and ``key``, or ``MISS``."""
        hit = self._entries.get(id(obj))
        return hit[2] if hit is not None and hit[0] is obj and hit[1] == key else MISS

    def put(self, obj: Any, key: Hashable, answer: T) -> T:
        if len(self._entries) >= self._size:
            self._entries.clear()
        self._entries[id(obj)] = (obj, key, answer)
        return answer


__all__ = ["MISS", "ObjectMemo"]
