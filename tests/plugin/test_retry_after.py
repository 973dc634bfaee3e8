"""``Retry-After`` as the plugin reads it (RFC 9110, 10.2.3): delta-seconds or an HTTP date, at most the ceiling."""

from __future__ import annotations

import email.utils

import pytest

from exporter.vllm_plugin.retry_after import MAX_WAIT_SECONDS, seconds_of

NOW = 1_796_000_000.0  # wall-clock seconds of the made-up present


def date(offset: float) -> str:
    """The IMF-fixdate ``offset`` seconds from ``NOW``."""
    return email.utils.formatdate(NOW + offset, usegmt=True)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        pytest.param("120", 120.0, id="delta-seconds"),
        pytest.param(" 7 ", 7.0, id="delta-seconds-with-spaces"),
        pytest.param("0", 0.0, id="zero"),
        pytest.param(f"{MAX_WAIT_SECONDS:.0f}", MAX_WAIT_SECONDS, id="delta-at-the-ceiling"),
        pytest.param(f"{MAX_WAIT_SECONDS + 1:.0f}", MAX_WAIT_SECONDS, id="delta-one-past-the-ceiling"),
        pytest.param("3600", MAX_WAIT_SECONDS, id="an-hour"),
        pytest.param("9" * 400, MAX_WAIT_SECONDS, id="beyond-any-float"),
        pytest.param(date(30), 30.0, id="http-date"),
        pytest.param(date(MAX_WAIT_SECONDS), MAX_WAIT_SECONDS, id="date-at-the-ceiling"),
        pytest.param(date(MAX_WAIT_SECONDS + 1), MAX_WAIT_SECONDS, id="date-one-past-the-ceiling"),
        pytest.param(date(-30), 0.0, id="date-past"),
        pytest.param(
            email.utils.formatdate(NOW + 30, usegmt=False).replace("+0000", "-0000"), 30.0, id="date-in-minus-0000"
        ),
    ],
)
def test_a_wait_asked_for_is_honoured_up_to_the_ceiling(value: str, seconds: float) -> None:
    assert seconds_of(value, NOW) == seconds


def test_the_obsolete_date_forms_http_still_allows() -> None:
    # RFC 850 and asctime, for 1994-11-06 08:49:37 GMT.
    then = 784_111_777.0
    assert seconds_of("Sunday, 06-Nov-94 08:49:37 GMT", then - 10) == 10.0
    assert seconds_of("Sun Nov  6 08:49:37 1994", then - 10) == 10.0


@pytest.mark.parametrize("value", [None, "", "soon", "-5", "1.5", "٣", "Thu, 99 Foo 2026 25:61:00 GMT"])
def test_anything_else_asks_for_nothing(value: str | None) -> None:
    assert seconds_of(value, NOW) is None
