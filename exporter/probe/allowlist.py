"""What ``/probe?target=`` may name, and which targets the allowlist lets the exporter fetch.

A target is ``HOST:PORT`` and nothing else (no scheme, user, path or query), so the one URL the probe fetches,
``<scheme>://HOST:PORT/metrics``, cannot be steered elsewhere. ``--probe.allowed-targets`` lists CIDRs
(``10.0.0.0/8``, ``fd00::/8``, a single address), which permit targets given as addresses inside them, and
``HOST:PORT`` patterns, which permit names (and addresses as written): matched label by label, ``*`` any run
of characters within one label and ``?`` one character, neither ever crossing a dot, so ``10.0.0.*:8000``
cannot permit ``10.0.0.7.attacker.example:8000``; a pattern of dotted digits and wildcards alone matches
addresses only. A name pattern trusts the name, whatever it resolves to. Whether a target is permitted is
known before any DNS lookup (the probe's: ``exporter/probe/addresses.py``): a name no pattern permits is refused
without one. No entry: probing is off.
Imports nothing of the exporter, so the settings can check the flag's entries at start-up.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# DNS names (labels of letters, digits and inner hyphens, joined by dots), IPv4 addresses, or IPv6 addresses in
# brackets; then the port.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_TARGET = re.compile(rf"(\[[0-9A-Fa-f:.]{{2,45}}\]|{_LABEL}(?:\.{_LABEL})*):[0-9]{{1,5}}")
MAX_TARGET = 261
# A HOST:PORT pattern: labels of a name's characters and the wildcards, or an [IPv6] pattern; then the port.
_NAME_PATTERN = re.compile(r"(\[[0-9A-Fa-f:.*?]+\]|[A-Za-z0-9*?-]+(?:\.[A-Za-z0-9*?-]+)*):[0-9*?]+")
# A pattern that can only mean IPv4 addresses: dotted digits and wildcards (10.0.0.*:8000, *.*.*.*:8000).
_ADDRESS_PATTERN = re.compile(r"[0-9*?]*\.[0-9.*?]*:[0-9*?]+")


@dataclass(frozen=True)
class ProbeTarget:
    """A probe target: the text as Prometheus sent it (the ``replica`` label), and the host and port in it."""

    text: str
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> ProbeTarget:
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
class NamePattern:
    """A ``HOST:PORT`` pattern of the allowlist: its text, and the expression it matches targets with."""

    text: str
    expression: re.Pattern[str]
    addresses_only: bool

    @classmethod
    def parse(cls, entry: str) -> NamePattern:
        """``*`` and ``?`` within one label of the host (never a dot or an IPv6 colon), digits in the port."""
        host, _, port = entry.lower().rpartition(":")
        wildcards = {"*": "[^.:]*", "?": "[^.:]"}
        digits = {"*": "[0-9]*", "?": "[0-9]"}
        expression = "".join(wildcards.get(char, re.escape(char)) for char in host) + ":"
        expression += "".join(digits.get(char, re.escape(char)) for char in port)
        return cls(entry, re.compile(expression), bool(_ADDRESS_PATTERN.fullmatch(entry)))

    def permits(self, target: ProbeTarget) -> bool:
        if self.addresses_only and target.address is None:
            return False
        return self.expression.fullmatch(target.normalized) is not None


@dataclass(frozen=True)
class AllowList:
    """The entries of ``--probe.allowed-targets``: networks and ``HOST:PORT`` name patterns."""

    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    names: tuple[NamePattern, ...] = ()

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
                    f"{entry!r} is neither a CIDR nor a HOST:PORT pattern (labels of letters, digits, - and the "
                    "wildcards * and ?, joined by dots; '*' as the port for any port)"
                )
            names.append(NamePattern.parse(entry))
        return cls(tuple(networks), tuple(names))

    def check(self, target: ProbeTarget) -> None:
        """Raise ``TargetForbidden`` unless an entry permits the target, without resolving it: a network an
        address target, a name pattern a name (or an address as written)."""
        if not self.networks and not self.names:
            raise TargetForbidden("probing is off: no --probe.allowed-targets configured")
        address = target.address
        if address is not None and any(address in network for network in self.networks):
            return
        if any(pattern.permits(target) for pattern in self.names):
            return
        if address is not None:
            raise TargetForbidden(f"{target.text} is not in --probe.allowed-targets")
        raise TargetForbidden(
            f"{target.text} matches no HOST:PORT pattern of --probe.allowed-targets (a CIDR permits addresses, "
            "not names)"
        )
