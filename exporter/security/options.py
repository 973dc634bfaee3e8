"""The web group of ``serve``'s flags, ``--web.*``: how the exporter listens, serves and checks credentials.
Declared here, beside the access it configures, so that ``security`` names its own flags in its messages
(``web_flag``) without the command line, which joins this group with the others into ``WebOptions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exporter.flags.option import file_setting, flag_in, setting
from exporter.security.addresses import LISTEN_ADDRESS_FLAG, allowed_hosts

# 9100-9999, Prometheus' exporter range, is fully allocated; see docs/operators.md, "Default port".
DEFAULT_PORT = 10987


@dataclass(frozen=True)
class WebOptions:
    """How the exporter listens and serves: ``--web.*``."""

    listen_address: str = setting(
        f"127.0.0.1:{DEFAULT_PORT}",
        LISTEN_ADDRESS_FLAG,
        f"HOST:PORT to listen on (:{DEFAULT_PORT}: every interface)",
    )
    telemetry_path: str = setting("/metrics", "--web.telemetry-path", "path of the metrics")
    workers: int = setting(1, "--web.workers", "worker processes sharing the storage")
    ingest_token_file: Path | None = file_setting(
        "--web.ingest-token-file",
        "file with the bearer tokens that ingest and changes require; without it ingest is open, "
        "on a loopback address only unless --web.allow-unauthenticated-ingest",
    )
    allow_unauthenticated_ingest: bool = setting(
        False, "--web.allow-unauthenticated-ingest", "allow ingest without a token on a non-loopback address"
    )
    metrics_token_file: Path | None = file_setting(
        "--web.metrics-token-file",
        "file with the bearer tokens that reading metrics and state requires; without it reading is open",
    )
    web_config_file: Path | None = file_setting(
        "--web.config.file",
        "exporter-toolkit web config (tls_server_config, basic_auth_users, http_server_config.headers), "
        "re-read when it changes; without it plain HTTP and no basic auth",
    )
    metrics_basic_auth_file: Path | None = file_setting(
        "--web.metrics-basic-auth-file",
        "deprecated, plain-text USER:PASSWORD lines; use basic_auth_users (bcrypt) in --web.config.file",
    )
    tls_cert_file: Path | None = file_setting(
        "--web.tls-cert-file",
        "TLS certificate (PEM); with --web.tls-key-file, serve HTTPS "
        "(tls_server_config of --web.config.file does the same)",
    )
    tls_key_file: Path | None = file_setting("--web.tls-key-file", "TLS private key (PEM)")
    max_request_bytes: int = setting(64 * 1024, "--web.max-request-bytes", "largest request body accepted (413 above)")
    read_timeout_seconds: float = setting(
        10.0, "--web.read-timeout", "seconds a client may take to send a request body (408 after)"
    )
    max_connections: int = setting(
        1024,
        "--web.max-connections",
        "concurrent connections; at the cap a new one closes an idle kept-alive one, else the one stalled longest on "
        "writing or in its request head, or gets 503 if none is",
    )
    keep_alive_timeout_seconds: float = setting(
        65.0,
        "--web.keep-alive-timeout",
        "seconds an idle connection is kept for its next request: longer than the plugin's heartbeat interval "
        "(30 s), so that its heartbeats reuse one connection",
    )
    max_header_bytes: int = setting(
        16 << 10, "--web.max-header-bytes", "largest request line and headers accepted (431 above)"
    )
    header_timeout_seconds: float = setting(
        10.0,
        "--web.header-timeout",
        "seconds a client may take to send a request's line and headers (408 after, connection closed)",
    )
    write_timeout_seconds: float = setting(
        10.0,
        "--web.write-timeout",
        "seconds a client may go without reading any of an answer the exporter cannot send on (connection aborted "
        "after, its buffers released)",
    )
    shutdown_timeout_seconds: float = setting(
        10.0,
        "--web.shutdown-timeout",
        "seconds SIGTERM waits for open requests; connections still open then are closed and the exporter exits 0",
    )
    # Host names served besides loopback ones; None serves any (see ``allowed_hosts``).
    allowed_hosts: tuple[str, ...] | None = setting(
        None,
        "--web.allowed-hosts",
        "comma-separated Host names served besides loopback ones, '*' for any (421 otherwise, against DNS "
        "rebinding); empty: on a loopback address only localhost, 127.0.0.0/8 and ::1, elsewhere any name",
        flag_default="",
        parse=allowed_hosts,
        context=("listen_address",),
    )


def web_flag(name: str) -> str:
    """The flag of the web setting ``name``, for messages: ``web_flag("tls_cert_file")`` is ``--web.tls-cert-file``."""
    return flag_in(WebOptions, name)
