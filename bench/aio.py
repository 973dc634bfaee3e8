"""An open-loop HTTP/1.1 load of scheduled requests, a periodic scraper and a sampler of the server's CPU and memory.

Each scheduled event is sent at its time whether or not earlier ones are answered (a fleet does not wait for the
exporter), at most ``in_flight`` at once; its latency counts from the time it was due, so a server that falls
behind shows it. An event of a client that keeps its connection (the plugin's ``sender.Connection``) goes on that
client's kept connection, any other on a connection of its own (prometheus_client's ``urllib``). Stdlib asyncio
only: one process drives hundreds of requests a second.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.load import Request, percentile
from bench.procs import HOST, process_cpu_seconds, rss_mb
from bench.wrk import raw


@dataclass(frozen=True)
class Event:
    """Requests due ``at`` seconds into a phase, sent one after another on one connection (a ``kind`` of event):
    the connection ``client`` keeps, or, without a ``client``, one of their own."""

    at: float
    kind: str
    requests: tuple[Request, ...]
    client: str | None = None


@dataclass
class Tally:
    """What came of a phase's events: per kind, each done event's (due offset, latency), errors and misses."""

    done: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)

    def add(self, event: Event, latency: float) -> None:
        self.done.setdefault(event.kind, []).append((event.at, latency))

    def fail(self, event: Event, reason: str) -> None:
        self.errors[event.kind] = self.errors.get(event.kind, 0) + 1
        self.statuses[reason] = self.statuses.get(reason, 0) + 1


async def _answer(reader: asyncio.StreamReader) -> tuple[int, int, bool]:
    """Read one HTTP/1.1 answer (``Content-Length`` or chunked): its status, body length, and whether the server
    closes the connection after it."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection")
    status = int(status_line.split()[1])
    length, chunked, closing = 0, False, False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            closing = b"close" in value.lower()
    if not chunked:
        await reader.readexactly(length)
        return status, length, closing
    total = 0
    while size := int((await reader.readline()).split(b";")[0], 16):
        await reader.readexactly(size + 2)
        total += size
    while await reader.readline() not in (b"\r\n", b""):
        pass
    return status, total, closing


Pair = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Connections:
    """The connections clients keep to the server between their events, one per client, across phases.

    A kept connection the server closed meanwhile (its keep-alive timeout, its connection cap) is found closed
    as it is used, before any answer: the event is sent again on a new one, as the plugin does.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self._idle: dict[str, Pair] = {}
        self.opened = 0  # connections opened, kept or not

    async def exchange(self, event: Event) -> int:
        """Send the event's requests one after another; the status of the first that is not 2xx, else 200."""
        kept = self._idle.pop(event.client, None) if event.client is not None else None
        if kept is not None:
            try:
                return await self._on(kept, event)
            except (ConnectionError, asyncio.IncompleteReadError):
                kept[1].close()
        self.opened += 1
        return await self._on(await asyncio.open_connection(HOST, self.port), event)

    async def _on(self, pair: Pair, event: Event) -> int:
        reader, writer = pair
        status, closing = 200, False
        try:
            for request in event.requests:
                writer.write(raw(request, self.port))
                status, _, closing = await _answer(reader)
                if closing or not 200 <= status < 300:
                    break
        except BaseException:
            writer.close()
            raise
        if event.client is None or closing or event.client in self._idle:
            writer.close()
        else:
            self._idle[event.client] = pair
        return status if not 200 <= status < 300 else 200

    def close(self) -> None:
        for _, writer in self._idle.values():
            writer.close()
        self._idle.clear()


async def drive(
    connections: Connections, events: Sequence[Event], in_flight: int, start: float, deadline: float, tally: Tally
) -> None:
    """Send each event at ``start + event.at`` (at most ``in_flight`` at once) until ``deadline`` (monotonic)."""
    slots = asyncio.Semaphore(in_flight)
    pending: set[asyncio.Task[None]] = set()

    async def send(event: Event) -> None:
        try:
            status = await connections.exchange(event)
        except (OSError, asyncio.IncompleteReadError, ValueError) as error:
            tally.fail(event, type(error).__name__)
        else:
            if status == 200:
                tally.add(event, time.monotonic() - start - event.at)
            else:
                tally.fail(event, str(status))
        finally:
            slots.release()

    try:
        for event in sorted(events, key=lambda event: event.at):
            await asyncio.sleep(max(0.0, start + event.at - time.monotonic()))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(slots.acquire(), remaining)
            except TimeoutError:
                break
            task = asyncio.create_task(send(event))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def scrape(
    port: int, request: Request, interval: float, start: float, deadline: float, stop: asyncio.Event | None = None
) -> list[list[float]]:
    """Scrape every ``interval`` seconds until ``deadline``, or until ``stop`` is set: [offset, seconds, bytes] of
    each.

    Each scrape on a connection of its own: servers close idle keep-alive connections within seconds (uvicorn
    after 5), and a scrape every 15 s would find its connection closed.
    """
    scrapes: list[list[float]] = []
    due = start
    while due < deadline and not (stop is not None and stop.is_set()):
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        begun = time.monotonic()
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            writer.write(raw(request, port))
            status, size, _ = await asyncio.wait_for(_answer(reader), max(0.001, deadline - begun))
        except TimeoutError:
            break
        finally:
            writer.close()
        if status != 200:
            raise RuntimeError(f"scrape answered {status}")
        scrapes.append([begun - start, time.monotonic() - begun, size])
        due += interval
    return scrapes


async def sample(pid: int, start: float, deadline: float, every: float = 1.0) -> list[list[float]]:
    """Every ``every`` seconds until ``deadline``: [offset, share of one core since the last sample, RSS MiB]."""
    samples: list[list[float]] = []
    last_time, last_cpu = time.monotonic(), process_cpu_seconds(pid)
    while True:
        await asyncio.sleep(max(0.0, min(every, deadline - time.monotonic())))
        now, cpu = time.monotonic(), process_cpu_seconds(pid)
        samples.append([now - start, (cpu - last_cpu) / max(now - last_time, 1e-9), rss_mb(pid) or 0.0])
        last_time, last_cpu = now, cpu
        if now >= deadline:
            return samples


def windows(done: Sequence[tuple[float, float]], width: float, until: float) -> list[list[float | None]]:
    """Per ``width``-second window of due offsets: [window start, p99 latency seconds or None, count]."""
    ordered = sorted(done)
    offsets = [at for at, _ in ordered]
    rows: list[list[float | None]] = []
    begin = 0.0
    while begin < until:
        low, high = bisect.bisect_left(offsets, begin), bisect.bisect_left(offsets, begin + width)
        latencies = [latency for _, latency in ordered[low:high]]
        rows.append([begin, percentile(latencies, 99) if latencies else None, float(len(latencies))])
        begin += width
    return rows


def summary(latencies: Sequence[float]) -> dict[str, Any]:
    """Count, p50, p99 and max in milliseconds."""
    if not latencies:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "count": len(latencies),
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "max_ms": max(latencies) * 1e3,
    }
