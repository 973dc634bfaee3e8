"""Listen addresses and the Host names they serve: which names are loopback ones, which are served besides."""

from __future__ import annotations

import functools
import ipaddress

from exporter.flags.option import SettingsError

LISTEN_ADDRESS_FLAG = "--web.listen-address"


def allowed_hosts(names: str, listen_address: str) -> tuple[str, ...] | None:
    """``--web.allowed-hosts``: a comma-separated list of host names served besides loopback ones; ``*`` serves
    any. Empty: loopback names only on a loopback listener (against DNS rebinding), any name otherwise."""
    hosts = tuple(name.strip().lower().rstrip(".") for name in names.split(",") if name.strip())
    if "*" in hosts or (not hosts and not is_loopback(split_listen_address(listen_address)[0])):
        return None
    return hosts


@functools.lru_cache(maxsize=256)  # asked of every request's Host header: the few names clients use
def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (IPv4 or IPv6): names DNS rebinding cannot point elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_listen_address(address: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (every IPv4 interface) as (host, port)."""
    host, separator, port = address.rpartition(":")
    if not separator or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SettingsError(f"{LISTEN_ADDRESS_FLAG} {address!r}: expected HOST:PORT")
    host = host.removeprefix("[").removesuffix("]") or "0.0.0.0"
    return host, int(port)
