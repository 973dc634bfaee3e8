"""The floor: a bare asyncio HTTP/1.1 server that does nothing but answer, stdlib only.

GET (any path) gets the fixed bytes of ``--body`` as ``--content-type``; POST and PUT
get an empty 200 once their body is read. Connections are kept alive. It works on
raw non-blocking sockets (``sock_recv``/``sock_sendall``, which sends a large body
without copying it), so what the benchmark measures against it is the cost of
HTTP on loopback alone.

    python bench/floor_server.py --port 18000 --body scrape.txt
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
from pathlib import Path

EMPTY_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
RECEIVE = 1 << 16


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


async def serve_connection(connection: socket.socket, get_answer: bytes) -> None:
    """Answer requests on one connection until the client closes it."""
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
            received = received[length:]
            await loop.sock_sendall(connection, get_answer if head.startswith(b"GET ") else EMPTY_OK)


async def serve(host: str, port: int, get_answer: bytes) -> None:
    loop = asyncio.get_running_loop()
    connections: set[asyncio.Task[None]] = set()
    with socket.create_server((host, port), backlog=1024) as listener:
        listener.setblocking(False)
        while True:
            connection, _ = await loop.sock_accept(listener)
            connection.setblocking(False)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(serve_connection(connection, get_answer))
            connections.add(task)
            task.add_done_callback(connections.discard)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--body", type=Path, required=True, help="file whose bytes every GET answers")
    parser.add_argument("--content-type", default="text/plain; version=0.0.4; charset=utf-8")
    args = parser.parse_args()
    answer = fixed_response(args.body.read_bytes(), args.content_type)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, answer))


if __name__ == "__main__":
    main()
