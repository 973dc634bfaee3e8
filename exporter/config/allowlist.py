"""What ``/probe?target=`` may name, and which targets the allowlist lets the exporter fetch.

A target is ``HOST:PORT`` and nothing else (no scheme, user, path or query), so the one URL the probe fetches,
``<scheme>://HOST:PORT/metrics``, cannot be steered elsewhere. ``--probe.allowed-targets`` lists CIDRs
(``10.0.0.0/8``, ``fd00::/8``, a single address) and ``HOST:PORT`` patterns with ``*`` and ``?`` wildcards
(``vllm-*.models.svc.cluster.local:8000``, ``gpu-node-?:*``). A name pattern trusts the name, whatever it
resolves to; a CIDR trusts addresses, so a name allowed only through a CIDR is resolved first and only the
addresses inside the CIDRs are connected to (the checked address itself, so DNS cannot answer differently
between the check and the connection). No entry: probing is off. Imports nothing of the exporter, so the
settings can check the flag's entries at start-up.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import re
import socket
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# DNS names (letters, digits, hyphens and dots), IPv4 addresses, or IPv6 addresses in brackets; then the port.
_TARGET = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?):[0-9]{1,5}")
MAX_TARGET = 261
# What a HOST:PORT pattern may hold: a target's characters and the wildcards.
_NAME_PATTERN = re.compile(r"(\[[0-9A-Fa-f:.*?]+\]|[A-Za-z0-9.*?-]+):[0-9*?]+")


@dataclass(frozen=True)
class Target:
    """A probe target: the text as Prometheus sent it (the ``replica`` label), and the host and port in it."""

    text: str
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Target:
        """``HOST:PORT``; a ``ValueError`` says what is wrong."""
        if not _TARGET.fullmatch(text):
            raise ValueError("expected HOST:PORT: a DNS name, an IPv4 address or an [IPv6] address, and a port")
        host, _, port = text.rpartition(":")
        if not 1 <= int(port) <= 65535:
            raise ValueError(f"port {port} is not from 1 to 65535")
        if host.startswith("["):
            host = host[1:-1]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise ValueError(f"[{host}] is not an IPv6 address") from None
        return cls(text, host.lower(), int(port))

    @property
    def address(self) -> IPAddress | None:
        """The host as an IP address, when it is one (no resolution needed)."""
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None

    @property
    def normalized(self) -> str:
        """``host:port`` in lower case, an IPv6 address in brackets: what name patterns are matched against."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class TargetForbidden(Exception):
    """The allowlist does not let the exporter fetch this target."""


@dataclass(frozen=True)
class AllowList:
    """The entries of ``--probe.allowed-targets``: networks and ``HOST:PORT`` name patterns."""

    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, entries: tuple[str, ...]) -> AllowList:
        """The entries, each a CIDR, an address or a ``HOST:PORT`` pattern; a ``ValueError`` names a wrong one."""
        networks, names = [], []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if not _NAME_PATTERN.fullmatch(entry):
                raise ValueError(
                    f"{entry!r} is neither a CIDR nor a HOST:PORT pattern (letters, digits, .-, * and ?; "
                    "'*' as the port for any port)"
                )
            names.append(entry.lower())
        return cls(tuple(networks), tuple(names))

    @property
    def empty(self) -> bool:
        return not self.networks and not self.names

    def names_permit(self, target: Target) -> bool:
        """A name pattern (or, for an address target, a network) permits the target without resolving it."""
        address = target.address
        if address is not None and self._network_permits(address):
            return True
        return any(fnmatch.fnmatchcase(target.normalized, pattern) for pattern in self.names)

    def _network_permits(self, address: IPAddress) -> bool:
        return any(address in network for network in self.networks)

    async def addresses(self, target: Target) -> list[str]:
        """The addresses to connect to, in the resolver's order: only those the allowlist permits.

        Raises ``TargetForbidden`` when none is, and ``OSError`` when the name does not resolve.
        """
        if self.empty:
            raise TargetForbidden("probing is off: no --probe.allowed-targets configured")
        by_name = self.names_permit(target)
        if target.address is not None:
            if not by_name:
                raise TargetForbidden(f"{target.text} is not in --probe.allowed-targets")
            return [target.host]
        if not by_name and not self.networks:
            raise TargetForbidden(f"{target.text} matches no pattern of --probe.allowed-targets")
        resolved = await asyncio.get_running_loop().getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        addresses = list(dict.fromkeys(str(info[4][0]) for info in resolved))
        if not by_name:
            addresses = [address for address in addresses if self._network_permits(ipaddress.ip_address(address))]
            if not addresses:
                raise TargetForbidden(f"{target.text} resolves to no address in --probe.allowed-targets")
        return addresses
