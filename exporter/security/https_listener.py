"""What the HTTPS listener serves: the certificate of the web config or of the older TLS flags, per handshake.

uvicorn builds the listener's context once; its SNI callback hands every handshake the context of the files as
they are now (``exporter/flags/watched_files.py``), so a renewed certificate applies without a restart.
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from pathlib import Path

from exporter.flags.watched_files import Watched
from exporter.security.options import WebOptions, web_flag
from exporter.security.tls import tls_context
from exporter.security.web_config import WebConfig, watched_web_config


@functools.cache
def _watched_tls_flags(cert_file: Path, key_file: Path) -> Watched[WebConfig]:
    """``--web.tls-cert-file`` and ``--web.tls-key-file``: reloaded on change like the web config's TLS."""
    cert_flag = web_flag("tls_cert_file")

    def load() -> tuple[WebConfig, tuple[Path, ...]]:
        context = tls_context(cert_file, key_file, f"{cert_flag}/{web_flag('tls_key_file')}")
        return WebConfig(context), (cert_file, key_file)

    return Watched(f"{cert_flag} {cert_file}", load)


def watched_tls(settings: WebOptions) -> Watched[WebConfig] | None:
    """Where the listener's certificate comes from; ``None``: plain HTTP."""
    if settings.web_config_file is not None:
        watched = watched_web_config(settings.web_config_file)
        return watched if watched.value.tls is not None else None
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        return _watched_tls_flags(settings.tls_cert_file, settings.tls_key_file)
    return None


@dataclass(frozen=True)
class ReloadingTls:
    """uvicorn's ``ssl_context_factory``: every handshake gets the certificate of the files as they are now.

    A picklable recipe (worker processes build their own): the settings' web config or TLS flags.
    """

    settings: WebOptions

    def __call__(self, config: object, default_factory: object) -> ssl.SSLContext:
        watched = watched_tls(self.settings)
        assert watched is not None and watched.value.tls is not None
        served = watched.value.tls
        # The listener's context only picks, per handshake, the context of the newest good files; protocol
        # versions are fixed when the connection is made, so they are kept in step on the listener's context.
        listener = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        listener.minimum_version, listener.maximum_version = served.minimum_version, served.maximum_version

        def pick(connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
            nonlocal served
            # A reload that drops TLS cannot turn a listening HTTPS port into plain HTTP: keep the last context.
            context = watched.current().tls or served
            if context is not served:
                served = context
                listener.minimum_version, listener.maximum_version = context.minimum_version, context.maximum_version
            connection.context = context

        listener.sni_callback = pick  # type: ignore[assignment]
        return listener
