"""Crash safety and graceful shutdown of the real server: nothing acknowledged is ever lost.

Every client request carries a unique ``num_gpu_blocks`` and goes to an engine slot of its own, so each
2xx answer can be looked up afterwards with its exact value. Figures: see ``tests/helpers/figures.py``.
"""

from __future__ import annotations

import http.client
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.figures import record
from tests.helpers.http import MSGPACK, raw_socket, read_until_closed, request
from tests.helpers.ready_responses import engine_blocks, ready_response
from tests.helpers.sqlite_file import integrity
from tests.support import ExporterProcess, wait_until

CLIENTS = 6
# Engines per deployment: each request takes the next engine, then the next deployment.
ENGINES = 64
CYCLES = 50
MIN_CYCLES = 20
BUDGET_SECONDS = 120.0
Slot = tuple[str, int]


class Ledger:
    """What the clients sent, what the exporter acknowledged, and when the clients may send."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.sent: dict[Slot, int] = {}
        self.acknowledged: dict[Slot, int] = {}
        self.unanswered: set[Slot] = set()
        self.refusals: Counter[int] = Counter()
        self.requests = 0
        self.acks = 0
        self.acks_this_run = 0
        self.paused = False
        self.done = False

    def wait_to_send(self) -> bool:
        """Block while the exporter is being killed and restarted; False once the test is over."""
        with self.lock:
            self.lock.wait_for(lambda: self.done or not self.paused, timeout=60)
            return not self.done

    def pause(self) -> None:
        with self.lock:
            self.paused = True

    def resume(self) -> None:
        with self.lock:
            self.paused = False
            self.acks_this_run = 0
            self.lock.notify_all()

    def finish(self) -> None:
        with self.lock:
            self.done = True
            self.lock.notify_all()

    def lost(self, stored: dict[Slot, int]) -> set[Slot]:
        """Slots whose last acknowledged value is not what is stored (nor a later, unanswered one)."""
        with self.lock:
            return {
                slot
                for slot, value in self.acknowledged.items()
                if stored.get(slot) != value and not (slot in self.unanswered and stored.get(slot) == self.sent[slot])
            }

    def phantom(self, stored: dict[Slot, int]) -> set[Slot]:
        """Stored slots whose value was never sent there."""
        with self.lock:
            return {slot for slot, value in stored.items() if self.sent.get(slot) != value}


def send(exporter: ExporterProcess, ledger: Ledger, slot: Slot, value: int, engines: int) -> bool:
    """POST one ready response carrying ``value`` to ``slot`` and note the outcome; False when unanswered."""
    with ledger.lock:
        ledger.sent[slot] = value
        ledger.requests += 1
    try:
        reply = request(
            exporter.url,
            "POST",
            f"/api/v1/deployments/{slot[0]}/ready",
            ready_response(slot[1], value, engines),
            MSGPACK,
        )
    except (OSError, http.client.HTTPException):
        with ledger.lock:  # the exporter went away before it answered: this one may or may not be stored
            ledger.unanswered.add(slot)
        return False
    with ledger.lock:
        if 200 <= reply.status < 300:
            ledger.acknowledged[slot] = value
            ledger.unanswered.discard(slot)
            ledger.acks += 1
            ledger.acks_this_run += 1
        else:
            ledger.refusals[reply.status] += 1
    return True


def client(exporter: ExporterProcess, ledger: Ledger, number: int) -> None:
    """Send ready responses, each to a new engine slot with a unique value, until the test is over."""
    sequence = 0
    while ledger.wait_to_send():
        slot = (f"crash-{number}-{sequence // ENGINES}", sequence % ENGINES)
        send(exporter, ledger, slot, number * 1_000_000 + sequence + 1, ENGINES)
        sequence += 1


def check_stored(exporter: ExporterProcess, ledger: Ledger) -> tuple[set[Slot], set[Slot]]:
    """(acknowledged but lost, stored but never sent) right now; the clients are paused."""
    reply = request(exporter.url, "GET", "/api/v1/deployments")
    assert reply.status == 200
    stored = engine_blocks(reply.json())
    return ledger.lost(stored), ledger.phantom(stored)


def test_sigkill_at_random_moments_loses_nothing_acknowledged(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    seed = int(os.environ.get("RELIABILITY_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    exporter = start_exporter()
    ledger = Ledger()
    threads = [threading.Thread(target=client, args=(exporter, ledger, n), daemon=True) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    cycles = 0
    lost: set[Slot] = set()
    phantom: set[Slot] = set()
    damaged: list[str] = []
    try:
        while cycles < CYCLES and time.monotonic() - started < BUDGET_SECONDS:
            # A random number of acknowledgements into this run, with the clients' next requests in flight.
            target = rng.randint(1, 40)
            wait_until(lambda target=target: ledger.acks_this_run >= target, timeout=30, interval=0.001)
            ledger.pause()
            assert exporter.stop(signal.SIGKILL) == -signal.SIGKILL
            check = integrity(exporter.storage)
            if check != "ok":
                damaged.append(check)
            exporter.start()
            lost_now, phantom_now = check_stored(exporter, ledger)
            lost |= lost_now
            phantom |= phantom_now
            cycles += 1
            ledger.resume()
    finally:
        ledger.finish()
        for thread in threads:
            thread.join(timeout=30)
    final_lost, final_phantom = check_stored(exporter, ledger)
    assert exporter.stop() == 0
    final_integrity = integrity(exporter.storage)
    figures = {
        "seed": seed,
        "cycles_survived": cycles,
        "requests_sent": ledger.requests,
        "acknowledged": ledger.acks,
        "unanswered_at_kill": len(ledger.unanswered),
        "refusals_by_status": dict(ledger.refusals),
        "server_errors_5xx": sum(count for status, count in ledger.refusals.items() if status >= 500),
        "acknowledged_but_lost": len(lost | final_lost),
        "stored_but_never_sent": len(phantom | final_phantom),
        "integrity_after_each_kill": damaged or "ok",
        "integrity_final": final_integrity,
        "seconds": round(time.monotonic() - started, 1),
    }
    record(record_property, "crash_safety", **figures)
    assert cycles >= MIN_CYCLES, figures
    assert figures["acknowledged_but_lost"] == 0, figures
    assert figures["stored_but_never_sent"] == 0, figures
    assert not ledger.refusals, figures
    assert not damaged and final_integrity == "ok", figures
    assert len(ledger.acknowledged) > cycles, figures


def stream(exporter: ExporterProcess, ledger: Ledger, number: int) -> None:
    """Send ready responses until the first one that is not answered (the exporter stopped listening)."""
    sequence = 0
    while ledger.wait_to_send() and send(exporter, ledger, (f"drain-{number}", sequence % 8), sequence + 1, 8):
        sequence += 1


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_finishes_the_request_in_flight_commits_and_exits_0(
    start_exporter: Callable[..., ExporterProcess], workers: int, record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter("--web.workers", str(workers))
    body = ready_response(0, 4242, 1)
    ledger = Ledger()
    streams = [threading.Thread(target=stream, args=(exporter, ledger, n), daemon=True) for n in range(4)]
    with raw_socket(exporter.url, timeout=20) as slow:
        # 100-continue: the "100 Continue" proves the request reached the app, which now waits for its body.
        slow.sendall(
            b"POST /api/v1/deployments/slow/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/vnd.msgpack\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        assert slow.recv(1024).startswith(b"HTTP/1.1 100 ")
        slow.sendall(body[: len(body) // 2])
        for thread in streams:
            thread.start()
        wait_until(lambda: ledger.acks_this_run >= 20, timeout=30)
        assert exporter.process is not None
        exporter.process.send_signal(signal.SIGTERM)
        wait_until(lambda: b"Shutting down" in exporter.log.read_bytes(), timeout=20)
        assert exporter.process.poll() is None, "the exporter exited with a request in flight"
        slow.sendall(body[len(body) // 2 :])
        answer = read_until_closed(slow)
    for thread in streams:
        thread.join(timeout=30)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert exporter.process.wait(timeout=30) == 0
    assert integrity(exporter.storage) == "ok"

    exporter.start()
    stored = engine_blocks(request(exporter.url, "GET", "/api/v1/deployments").json())
    lost = len(ledger.lost(stored))
    figures = {
        "workers": workers,
        "requests_sent": ledger.requests + 1,
        "acknowledged": ledger.acks + 1,
        "server_errors_5xx": sum(count for status, count in ledger.refusals.items() if status >= 500),
        "acknowledged_but_lost": lost + (stored.get(("slow", 0)) != 4242),
        "exit_code": 0,
    }
    record(record_property, f"graceful_shutdown_workers_{workers}", **figures)
    assert stored[("slow", 0)] == 4242
    assert lost == 0 and not ledger.refusals, figures
    assert exporter.stop() == 0
    assert integrity(exporter.storage) == "ok"
