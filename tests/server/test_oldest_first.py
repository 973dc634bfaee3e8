"""``OldestFirst``: the connections that may make room at the cap, the oldest at hand."""

from __future__ import annotations

from exporter.server.oldest_first import OldestFirst


def test_the_oldest_is_the_one_added_first_and_adding_again_makes_it_the_newest() -> None:
    items: OldestFirst[str] = OldestFirst()
    for item in "abc":
        items.add(item)
    assert items.oldest(lambda item: True) == "a"
    items.add("a")  # armed again: now the newest
    assert items.oldest(lambda item: True) == "b"
    items.discard("b")
    items.discard("b")  # discarding what is not there changes nothing
    assert items.oldest(lambda item: True) == "c"


def test_older_items_that_no_longer_qualify_are_dropped_and_none_when_none_is_left() -> None:
    items: OldestFirst[str] = OldestFirst()
    for item in "abc":
        items.add(item)
    busy = {"a", "b"}
    assert items.oldest(lambda item: item not in busy) == "c"
    busy.clear()
    assert items.oldest(lambda item: True) == "c"  # a and b were dropped on the way
    assert items.oldest(lambda item: False) is None
    assert items.oldest(lambda item: True) is None
