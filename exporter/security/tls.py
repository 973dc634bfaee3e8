"""A server TLS context from a PEM certificate and key, as ``tls_server_config`` and ``--web.tls-*-file`` give them."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Literal

from exporter.flags.option import SettingsError

TlsVersion = Literal["TLS10", "TLS11", "TLS12", "TLS13"]
TLS_VERSIONS: dict[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}


def tls_context(
    cert_file: Path, key_file: Path, where: str, minimum: TlsVersion = "TLS12", maximum: TlsVersion = "TLS13"
) -> ssl.SSLContext:
    """A server context with this certificate and key; a pair that does not load is a ``SettingsError``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS[minimum]
    context.maximum_version = TLS_VERSIONS[maximum]
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as error:
        reason = error.strerror or error.reason if isinstance(error, OSError) else error.reason or str(error)
        raise SettingsError(f"{where}: cannot load {cert_file} and {key_file}: {reason}") from None
    return context
