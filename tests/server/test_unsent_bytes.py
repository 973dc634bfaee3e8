"""``unsent_bytes``: what the kernel still holds of an answer its peer's kernel has not acknowledged (the peer
reads nothing, its window is closed), over a real loopback connection."""

from __future__ import annotations

import socket
import time
from typing import Any

from exporter.server.uvicorn_adapter import unsent_bytes


class SocketOnly:
    """The part of a transport ``unsent_bytes`` reads: its socket."""

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock

    def get_extra_info(self, name: str) -> Any:
        return self.sock if name == "socket" else None


def test_what_the_peer_has_not_taken_is_counted_and_nothing_once_it_has() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a window that closes at once
        client.connect(listener.getsockname())
        server, _ = listener.accept()
        with client, server:
            assert unsent_bytes(SocketOnly(server)) == 0  # type: ignore[arg-type]
            server.setblocking(False)
            sent = server.send(b"x" * (1 << 20))  # as much as the kernel takes: more than the peer's window
            assert unsent_bytes(SocketOnly(server)) > 0  # type: ignore[arg-type]  # the peer read nothing
            taken = 0
            while taken < sent:
                taken += len(client.recv(1 << 16))
            deadline = time.monotonic() + 5
            while unsent_bytes(SocketOnly(server)) and time.monotonic() < deadline:  # type: ignore[arg-type]
                time.sleep(0.01)  # polled with a deadline: the kernel frees it as the peer's ACK arrives
            assert unsent_bytes(SocketOnly(server)) == 0  # type: ignore[arg-type]


def test_a_transport_without_a_socket_counts_nothing() -> None:
    assert unsent_bytes(SocketOnly(None)) == 0  # type: ignore[arg-type]
