"""The one DNS lookup a probe makes: the addresses to connect to, of a target the allowlist permitted
(``AllowList.check``, ``exporter/probe/allowlist.py``, which decides without resolving anything)."""

from __future__ import annotations

import asyncio
import socket

from exporter.probe.allowlist import ProbeTarget


async def addresses_of(target: ProbeTarget) -> list[str]:
    """A target's own address, or its name's addresses in the resolver's order (``OSError`` when the name does not
    resolve)."""
    if target.address is not None:
        return [target.host]
    resolved = await asyncio.get_running_loop().getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in resolved))
