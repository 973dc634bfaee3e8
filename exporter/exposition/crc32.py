"""CRC-32 (gzip's) of a concatenation from the CRC-32s of its parts: zlib's ``crc32_combine``, which Python's zlib
module does not expose.

A gzip stream ends with the CRC-32 of everything it holds. Where the stream is built of parts compressed at
different times (only the changed ones again), the whole's CRC must come from the parts' CRCs without reading
their bytes again. zlib's method: appending ``n`` bytes whose CRC is ``b`` to bytes whose CRC is ``a`` gives
``a * x^(8n) + b`` in GF(2) modulo the CRC polynomial (bit-reflected, as zlib keeps them). ``shift(n)`` is that
``x^(8n)``, which a part keeps, so combining it is one multiplication.
"""

from __future__ import annotations

# The CRC-32 polynomial, bit-reflected.
_POLY = 0xEDB88320
_ONE = 1 << 31  # x^0, reflected


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial (both reflected), as zlib's ``multmodp``."""
    product = 0
    bit = _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """``x^(2^k)`` for k = 0..31: squaring the previous."""
    powers = [_ONE >> 1]  # x^1
    for _ in range(31):
        powers.append(_multiply(powers[-1], powers[-1]))
    return powers


_X_2K = _powers()


def shift(length: int) -> int:
    """``x^(8 * length)``: what a CRC is multiplied by when ``length`` bytes are appended (zlib's
    ``crc32_combine_gen``)."""
    power = _ONE
    k = 3  # 8 * length = length * 2^3
    while length:
        if length & 1:
            power = _multiply(_X_2K[k % 32], power)
        length >>= 1
        k += 1
    return power


def combine(first: int, second: int, second_shift: int) -> int:
    """The CRC-32 of two byte strings one after the other, from their CRC-32s and ``shift`` of the second's
    length."""
    return _multiply(second_shift, first) ^ second
