"""Facts about a list of tensors, found once per list.

A region's tensors come back with every transfer of it, and what a transfer needs of them
(each tensor's address, block size and stride; for the copy kernel its uploaded rows; for
a socket a view of each tensor's memory) costs microseconds per tensor per transfer to work
out again: 64 tensors' geometry ~60 us and their checks ~250 us of CPU on the H200 host; a
host tensor's view and checks ~10 us on the 2-core machine. ``PerTensorList`` makes such a
value on the first transfer of a list and hands it back after.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

_T = TypeVar("_T")


class PerTensorList(Generic[_T]):
    """``make(tensors)``, once per list of tensors. Entries are keyed by id() of the list's
    first tensor (a WeakKeyDictionary would compare tensors with ==, elementwise) and hold
    weak references to every tensor: an entry answers only the same tensor objects, and it
    goes when the first of them is freed. Plain dict operations are atomic under the GIL,
    and the weakref callback may run in any thread, so no lock."""

    def __init__(self, make: Callable[[Sequence[Any]], _T]) -> None:
        self._make = make
        # id(first tensor) -> (weakrefs to the tensors, the value, the first's watching ref)
        self._entries: dict[int, tuple[tuple[weakref.ref[Any], ...], _T, Any]] = {}

    def get(self, tensors: Sequence[Any]) -> _T:
        if not len(tensors):
            return self._make(tensors)
        key = id(tensors[0])
        found = self._entries.get(key)
        if found is not None:
            refs, value, _ = found
            if len(refs) == len(tensors) and all(
                    r() is t for r, t in zip(refs, tensors, strict=True)):
                return value
        value = self._make(tensors)
        entries = self._entries
        entry: tuple[tuple[weakref.ref[Any], ...], _T, Any] | None = None

        def forget(_ref: Any, key: int = key) -> None:
            if entries.get(key) is entry:
                entries.pop(key, None)

        entry = (tuple(weakref.ref(t) for t in tensors), value, weakref.ref(tensors[0], forget))
        entries[key] = entry
        return value

    def __len__(self) -> int:
        return len(self._entries)
