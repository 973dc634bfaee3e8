"""The floor: a bare asyncio HTTP/1.1 server that does nothing but answer, stdlib only.

GET (any path) gets the fixed bytes of ``--body`` as ``--content-type``; POST and PUT
get an empty 200 once their body is read. Connections are kept alive. It works on
raw non-blocking sockets (``sock_recv``/``sock_sendall``, which sends a large body
without copying it), so what the benchmark measures against it is the cost of
HTTP on loopback alone.

With ``--commit-per-post PATH`` it is the floor of a durable ingest instead: each POST
or PUT body is inserted as one row of a SQLite file and committed, with the exporter's
own pragmas (``exporter/state/storage.py``: WAL, ``synchronous=FULL``), before its 200
goes out; inline on the event loop, as a naive durable server would do it. Everything
else is the same loop.

    python bench/floor_server.py --port 18000 --body scrape.txt [--commit-per-post floor.db]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sqlite3
from collections.abc import Callable
from pathlib import Path

EMPTY_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
RECEIVE = 1 << 16
# The exporter's durability settings (exporter/state/storage.py), so this floor costs what its commits cost;
# the floor stays stdlib only, so they are repeated here, and tests/bench checks they are still the exporter's.
DURABLE_PRAGMAS = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL")
# Called with the path and body of each POST or PUT before its 200 goes out.
Commit = Callable[[bytes, bytes], None]


def fixed_response(body: bytes, content_type: str) -> bytes:
    """The whole GET answer, headers and body, built once."""
    head = f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode("ascii") + body


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def sqlite_commit(path: Path) -> Commit:
    """One row per POST or PUT, each its own durable transaction: what a naive durable ingest costs."""
    db = sqlite3.connect(path, isolation_level=None)  # autocommit: each INSERT is one transaction, one commit
    for pragma in DURABLE_PRAGMAS:
        db.execute(pragma)
    db.execute("CREATE TABLE IF NOT EXISTS posts (id INTEGER PRIMARY KEY, path BLOB NOT NULL, body BLOB NOT NULL)")

    def commit(request_path: bytes, body: bytes) -> None:
        db.execute("INSERT INTO posts (path, body) VALUES (?, ?)", (request_path, body))

    return commit


async def serve_connection(connection: socket.socket, get_answer: bytes, commit: Commit | None = None) -> None:
    """Answer requests on one connection until the client closes it; each POST or PUT is committed first if
    ``commit`` is given."""
    loop = asyncio.get_running_loop()
    received = b""
    with connection, contextlib.suppress(ConnectionError):
        while True:
            while (end := received.find(b"\r\n\r\n")) < 0:
                chunk = await loop.sock_recv(connection, RECEIVE)
                if not chunk:
                    return
                received += chunk
            head, received = received[: end + 4], received[end + 4 :]
            length = content_length(head)
            while len(received) < length:
                chunk = await loop.sock_recv(connection, RECEIVE)
                if not chunk:
                    return
                received += chunk
            body, received = received[:length], received[length:]
            if head.startswith(b"GET "):
                answer = get_answer
            else:
                if commit is not None:
                    commit(head.split(b" ", 2)[1], body)
                answer = EMPTY_OK
            await loop.sock_sendall(connection, answer)


async def serve(host: str, port: int, get_answer: bytes, commit: Commit | None = None) -> None:
    loop = asyncio.get_running_loop()
    connections: set[asyncio.Task[None]] = set()
    with socket.create_server((host, port), backlog=1024) as listener:
        listener.setblocking(False)
        while True:
            connection, _ = await loop.sock_accept(listener)
            connection.setblocking(False)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(serve_connection(connection, get_answer, commit))
            connections.add(task)
            task.add_done_callback(connections.discard)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--body", type=Path, required=True, help="file whose bytes every GET answers")
    parser.add_argument("--content-type", default="text/plain; version=0.0.4; charset=utf-8")
    parser.add_argument("--commit-per-post", type=Path, metavar="PATH",
                        help="SQLite file: commit each POST or PUT body as a row there before its 200")  # fmt: skip
    args = parser.parse_args()
    answer = fixed_response(args.body.read_bytes(), args.content_type)
    commit = None if args.commit_per_post is None else sqlite_commit(args.commit_per_post)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, answer, commit))


if __name__ == "__main__":
    main()
