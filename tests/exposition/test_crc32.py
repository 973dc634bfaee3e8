"""CRC-32 of a concatenation from its parts' (exporter/exposition/crc32.py), against zlib's CRC of the whole."""

from __future__ import annotations

import random
import zlib

from exporter.exposition.crc32 import combine, shift


def test_combining_parts_gives_zlibs_crc_of_the_whole_at_every_kind_of_length() -> None:
    rng = random.Random(7)
    for first_length, second_length in [(0, 0), (0, 1), (1, 0), (1, 1), (3, 1000), (65_537, 4), (12, 1 << 20)]:
        first, second = rng.randbytes(first_length), rng.randbytes(second_length)
        combined = combine(zlib.crc32(first), zlib.crc32(second), shift(len(second)))
        assert combined == zlib.crc32(first + second), (first_length, second_length)


def test_many_parts_combined_in_turn_give_the_crc_of_all_of_them() -> None:
    rng = random.Random(11)
    parts = [rng.randbytes(rng.randrange(0, 5000)) for _ in range(200)]
    crc = 0
    for part in parts:
        crc = combine(crc, zlib.crc32(part), shift(len(part)))
    assert crc == zlib.crc32(b"".join(parts))
