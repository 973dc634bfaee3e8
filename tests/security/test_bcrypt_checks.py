"""Basic auth with bcrypt under attack: failed guesses cannot starve scrapes, nor tell which users exist."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import bcrypt
import pytest

from exporter.security.bcrypt_checks import AuthenticationBusy, BcryptChecks
from tests.helpers.exposition import samples
from tests.helpers.figures import record
from tests.helpers.health import health_latency, recovery_seconds
from tests.helpers.http import Reply, raw_socket, read_until_closed, request
from tests.security.test_security import basic
from tests.support import ExporterProcess, wait_until

PASSWORD = "the-right-password"
CHECKS = "cache_config_exporter_password_checks_total"


def web_config(directory: Path, cost: int, users: tuple[str, ...] = ("prometheus",)) -> Path:
    path = directory / "web.yml"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=cost)).decode()
    path.write_text("basic_auth_users:\n" + "".join(f"  {user}: {hashed}\n" for user in users))
    return path


def raw_get(url: str, path: str, headers: dict[str, str]) -> bytes:
    """``GET path`` as bytes on the wire, with ``Connection: close``."""
    host = urlsplit(url).hostname
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def timed(call: Callable[[], Reply], timeout: float) -> float:
    started = time.monotonic()
    try:
        ok = call().status == 200
    except OSError:
        ok = False
    return time.monotonic() - started if ok else timeout


def p99(latencies: list[float]) -> float:
    return sorted(latencies)[max(0, round(0.99 * len(latencies)) - 1)]


class Flood:
    """``count`` clients sending ``GET /metrics`` with ``headers`` back to back (each waiting for its answer)."""

    def __init__(self, url: str, count: int, headers: dict[str, str]) -> None:
        self.answers: dict[int, int] = {}
        self._request = raw_get(url, "/metrics", headers)
        self._url = url
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._guess, daemon=True) for _ in range(count)]

    def _guess(self) -> None:
        while not self._stop.is_set():
            try:
                with raw_socket(self._url, timeout=15) as connection:
                    connection.sendall(self._request)
                    answer = read_until_closed(connection)
                status = int(answer.split(b" ", 2)[1]) if answer else 0
            except (OSError, ValueError, IndexError):
                status = 0
            with self._lock:
                self.answers[status] = self.answers.get(status, 0) + 1

    def __enter__(self) -> Flood:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=20)


def checks_done(reply: Reply) -> dict[str, float]:
    return {sample.labels["outcome"]: sample.value for sample in samples(reply.text, CHECKS)}


def checked(outcomes: dict[str, float]) -> float:
    """Passwords that reached the checks: all but the remembered ones."""
    return sum(count for outcome, count in outcomes.items() if outcome != "remembered")


# Cost 10 (tens of milliseconds a check here) keeps the test short and hurts when unbounded; cost 12, the
# README's and bcrypt's default, shows that the bound does not depend on the cost.
@pytest.mark.parametrize("cost", [10, 12])
def test_wrong_passwords_do_not_starve_an_authenticated_scrape_or_the_health_check(
    start_exporter: Callable[..., ExporterProcess],
    tmp_path: Path,
    record_property: Callable[[str, object], None],
    cost: int,
) -> None:
    exporter = start_exporter("--web.config.file", str(web_config(tmp_path, cost)))
    right = basic("prometheus", PASSWORD)

    def scrape() -> Reply:
        return request(exporter.url, "GET", "/metrics", headers=right, timeout=15)

    def counted(at_least: float) -> dict[str, float]:
        """The outcomes once they count ``at_least`` checks (the exporter's own metrics lag up to a second)."""

        def enough() -> dict[str, float] | None:
            outcomes = checks_done(scrape())
            return outcomes if checked(outcomes) >= at_least else None

        found: dict[str, float] = wait_until(enough)
        return found

    def measured(flood: Flood | None) -> tuple[list[float], list[float]]:
        """Scrape and ``/-/healthy`` latencies, 100 of each, alone or while ``flood`` runs."""
        if flood is not None:
            wait_until(lambda: sum(flood.answers.values()) >= 24, timeout=30)
        return [timed(scrape, 15) for _ in range(100)], [health_latency(exporter.url, 15) for _ in range(100)]

    assert scrape().status == 200, "the right password is checked once, then remembered"
    idle, idle_health = measured(None)
    # The floor: the same number of clients sending the cheapest refusal there is, a request without credentials.
    with Flood(exporter.url, 24, {}) as unauthenticated:
        flooded, flooded_health = measured(unauthenticated)
    with Flood(exporter.url, 24, basic("prometheus", "a-wrong-guess")) as guessers:
        attacked, attacked_health = measured(guessers)
    answered = guessers.answers.get(401, 0) + guessers.answers.get(503, 0) + 1  # and the right password at first
    before = counted(answered)
    # Hang-ups: requests sent with a wrong password and closed at once, as fast as a client can.
    hung_up = 0
    for _ in range(400):
        with raw_socket(exporter.url) as connection:
            connection.sendall(raw_get(exporter.url, "/metrics", basic("prometheus", "gone")))
        hung_up += 1
    recovered = recovery_seconds(exporter.url, bound=60)
    after_hang_ups = timed(scrape, 15)
    after = counted(checked(before) + hung_up)
    hashed_for_hang_ups = sum(after[outcome] - before[outcome] for outcome in ("right", "wrong"))

    figures = {
        "bcrypt_cost": cost,
        "guessers": 24,
        "guesses_answered": guessers.answers,
        "idle_scrape_p99_ms": round(1000 * p99(idle), 1),
        "unauthenticated_flood_scrape_p99_ms": round(1000 * p99(flooded), 1),
        "unauthenticated_flood_health_p99_ms": round(1000 * p99(flooded_health), 1),
        "attacked_scrape_p50_ms": round(1000 * statistics.median(attacked), 1),
        "attacked_scrape_p99_ms": round(1000 * p99(attacked), 1),
        "idle_health_p99_ms": round(1000 * p99(idle_health), 1),
        "attacked_health_p99_ms": round(1000 * p99(attacked_health), 1),
        "hang_ups": hung_up,
        "hang_ups_hashed": hashed_for_hang_ups,
        "hang_ups_by_outcome": {outcome: after[outcome] - before[outcome] for outcome in ("busy", "client_gone")},
        "healthy_again_after_hang_ups_s": round(recovered, 3),
        "scrape_after_hang_ups_ms": round(1000 * after_hang_ups, 1),
    }
    record(record_property, "bcrypt_guesses_against_scrapes", **figures)
    # Failed guesses cost the scrapes little more than as many requests without credentials (3x and 30 ms of
    # noise on a shared machine), and stay within 20x idle + 100 ms in any case.
    for name, latencies, floor, alone in (
        ("scrape", attacked, flooded, idle),
        ("/-/healthy", attacked_health, flooded_health, idle_health),
    ):
        assert p99(latencies) <= 3 * p99(floor) + 0.03, f"{name} p99 past 3x the unauthenticated flood's: {figures}"
        assert p99(latencies) <= 20 * p99(alone) + 0.1, f"{name} p99 past 20x idle + 100 ms: {figures}"
    assert recovered < 1.0 and after_hang_ups < 1.0, f"hung-up guesses were still being checked: {figures}"
    assert hashed_for_hang_ups <= 2, f"bcrypt ran for clients that had hung up: {figures}"
    assert sum(count for status, count in guessers.answers.items() if status not in (401, 503)) == 0, figures


def test_a_full_check_queue_answers_at_once_with_retry_after(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    """Past the cap of waiting checks a guess is refused at once: 503, Retry-After, a problem naming the header."""
    exporter = start_exporter("--web.config.file", str(web_config(tmp_path, 13)))
    wrong = raw_get(exporter.url, "/metrics", basic("prometheus", "a-wrong-guess"))
    connections = [raw_socket(exporter.url, timeout=30) for _ in range(32)]
    try:
        for connection in connections:
            connection.sendall(wrong)
        started = time.monotonic()
        busy = Reply.parse(read_until_closed(connections[-1]))
        waited = time.monotonic() - started
    finally:
        for connection in connections:
            connection.close()
    problem = busy.problem(503)
    assert busy.headers["retry-after"] == "1" and problem["field"] == "Authorization"
    assert waited < 1.0, f"the refusal took {waited:.3f}s: it waited for a check"


def test_the_check_past_the_cap_of_waiting_checks_is_refused_and_the_one_at_it_is_not() -> None:
    """With room for two checks (one running, one waiting), a third guess at the same moment is refused at once."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4))

    async def three_guesses_at_once() -> list[bool | BaseException]:
        checks = BcryptChecks(workers=1, waiting=2)
        guesses = (checks.matches("prometheus", b"a-wrong-guess", hashed, 4, lambda: False) for _ in range(3))
        return await asyncio.gather(*guesses, return_exceptions=True)

    first, second, third = asyncio.run(three_guesses_at_once())
    assert (first, second) == (False, False)
    assert isinstance(third, AuthenticationBusy)


def test_an_unknown_user_takes_as_long_as_a_known_one_with_a_wrong_password(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    # Cost 8 (a few milliseconds): a stand-in hash of any other cost shows as a ratio far from 1.
    exporter = start_exporter("--web.config.file", str(web_config(tmp_path, 8)))

    def check(user: str) -> float:
        started = time.monotonic()
        assert request(exporter.url, "GET", "/metrics", headers=basic(user, "wrong")).status == 401
        return time.monotonic() - started

    known, unknown = [], []
    for _ in range(15):
        known.append(check("prometheus"))
        unknown.append(check("nobody"))
    ratio = statistics.median(unknown) / statistics.median(known)
    record(
        record_property,
        "bcrypt_unknown_user_timing",
        bcrypt_cost=8,
        known_ms=round(1000 * statistics.median(known), 2),
        unknown_ms=round(1000 * statistics.median(unknown), 2),
        ratio=round(ratio, 2),
    )
    assert 0.7 <= ratio <= 1.4, f"unknown/known wrong-password time ratio {ratio:.2f}"
