"""The connections that may make room at the connection cap, each kind kept oldest first.

At the cap, every new connection closes one that waits idle, or the one stalled on writing longest, or the one
whose head has been incomplete longest. Found by scanning every open connection, that costs each accept the
cap's count of looks (256 connections: most of the loop's time under a flood of connections reopened as they
drop). Kept here as they start waiting, the oldest is at hand: a timer armed with the same timeout for each
runs out in the order they were armed, so the order of arming is the order of running out.

Knows no uvicorn and no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class OldestFirst(Generic[T]):
    """Items in the order they were last added; the oldest found at once."""

    def __init__(self) -> None:
        self._items: OrderedDict[T, None] = OrderedDict()

    def add(self, item: T) -> None:
        """Add ``item``, or move it behind the others: it is now the newest."""
        self._items[item] = None
        self._items.move_to_end(item)

    def discard(self, item: T) -> None:
        self._items.pop(item, None)

    def oldest(self, still: Callable[[T], bool]) -> T | None:
        """The oldest item for which ``still`` holds; older ones for which it no longer does (their state changed
        without their being discarded) are dropped. ``None`` if none is left."""
        while self._items:
            item = next(iter(self._items))
            if still(item):
                return item
            del self._items[item]
        return None
