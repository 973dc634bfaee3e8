"""Passwords remembered once verified (exporter/security/bcrypt_cache.py): only the same user, password and hash
find them, and the most recently used stay."""

from __future__ import annotations

from exporter.security.bcrypt_cache import VerifiedCache


def test_the_verified_cache_keeps_the_most_recently_used_entries() -> None:
    cache = VerifiedCache(size=2)
    cache.add("a", b"1", b"h")
    cache.add("b", b"2", b"h")
    assert ("a", b"1", b"h") in cache  # now the most recent
    cache.add("c", b"3", b"h")
    assert ("b", b"2", b"h") not in cache and ("a", b"1", b"h") in cache and ("c", b"3", b"h") in cache
    assert ("a", b"1", b"other hash") not in cache and ("a", b"other password", b"h") not in cache


def test_a_remembered_password_lets_in_no_other_user_whose_name_and_password_run_together_alike() -> None:
    cache = VerifiedCache()
    cache.add("ab", b"c", b"h")
    assert ("ab", b"c", b"h") in cache
    assert ("a", b"bc", b"h") not in cache
    assert ("abc", b"", b"h") not in cache
    assert ("ab", b"", b"ch") not in cache
