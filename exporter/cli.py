"""The ``cache-config-exporter`` command: ``serve`` runs the exporter, ``push`` sends it a ready response.

Every flag can also come from an environment variable, named after the flag:
``--web.listen-address`` is ``CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exporter import __version__
from exporter.settings import (
    DEFAULT_PORT,
    SETTINGS_ENVIRONMENT,
    Settings,
    SettingsError,
    allowed_hosts,
    default_storage_path,
    read_secret,
    split_listen_address,
)
from exporter.storage import StorageError, Store
from exporter.vllm_plugin import DEFAULT_TIMEOUT_SECONDS

ENV_PREFIX = "CACHE_CONFIG_EXPORTER_"
LOG_LEVELS = ("debug", "info", "warning", "error")
PUSH_FORMATS = {"auto": "", "json": "application/json", "msgpack": "application/vnd.msgpack"}
_TRUE = ("1", "true", "yes", "on")


def env_name(flag: str) -> str:
    """``--web.listen-address`` -> ``CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS``."""
    return ENV_PREFIX + flag.lstrip("-").replace(".", "_").replace("-", "_").upper()


def _add(parser: argparse.ArgumentParser, flag: str, help_text: str, default: object = None, **kwargs: Any) -> None:
    """A flag whose default comes from its environment variable, then from ``default``."""
    variable = env_name(flag)
    dest = variable.removeprefix(ENV_PREFIX).lower()
    if kwargs.pop("switch", False):
        enabled = os.environ.get(variable, "").lower() in _TRUE
        parser.add_argument(flag, dest=dest, action="store_true", default=enabled, help=f"{help_text} (env {variable})")
        return
    parser.add_argument(
        flag,
        dest=dest,
        default=os.environ.get(variable, default),
        help=f"{help_text} (env {variable}; default: %(default)s)",
        **kwargs,
    )


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cache-config-exporter",
        description="Prometheus exporter of the KV-cache configuration vLLM engines really run with.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the exporter")
    _add(serve, "--web.listen-address", "HOST:PORT to listen on (:PORT: every interface)", f"127.0.0.1:{DEFAULT_PORT}")
    _add(serve, "--web.telemetry-path", "path of the metrics", "/metrics")
    _add(serve, "--web.workers", "worker processes sharing the storage", 1, type=int)
    _add(serve, "--web.ingest-token-file", "file with the bearer token that ingest and changes require")
    _add(
        serve,
        "--web.allow-unauthenticated-ingest",
        "allow ingest without a token on a non-loopback address",
        switch=True,
    )
    _add(serve, "--web.metrics-token-file", "file with a bearer token that reading metrics and state requires")
    _add(
        serve,
        "--web.metrics-basic-auth-file",
        "deprecated, plain-text USER:PASSWORD lines; use basic_auth_users (bcrypt) in --web.config.file",
    )
    _add(serve, "--web.tls-cert-file", "TLS certificate (PEM); with --web.tls-key-file, serve HTTPS")
    _add(serve, "--web.tls-key-file", "TLS private key (PEM)")
    _add(
        serve,
        "--web.config.file",
        "exporter-toolkit web config (tls_server_config, basic_auth_users, http_server_config.headers), "
        "re-read when it changes",
    )
    _add(serve, "--web.max-request-bytes", "largest request body accepted", 64 * 1024, type=int)
    _add(serve, "--web.read-timeout", "seconds a client may take to send a request body", 10.0, type=float)
    _add(serve, "--web.max-connections", "concurrent connections before new ones get 503", 1024, type=int)
    _add(serve, "--web.max-header-bytes", "largest request line and headers accepted (431 above)", 16 << 10, type=int)
    _add(serve, "--web.header-timeout", "seconds a client may take to send a request's line and headers", 10.0,
         type=float)  # fmt: skip
    _add(serve, "--web.shutdown-timeout", "seconds SIGTERM waits for open requests before closing them", 10.0,
         type=float)  # fmt: skip
    _add(serve, "--web.allowed-hosts", "comma-separated Host names served besides loopback ones ('*': any; "
         "empty: loopback names only on a loopback address, any name otherwise)", "")  # fmt: skip
    _add(serve, "--limits.deployments", "most deployments kept", 10_000, type=int)
    _add(serve, "--limits.replicas-per-deployment", "most replicas (vLLM servers) kept per deployment", 1_024, type=int)
    _add(serve, "--limits.engines-per-deployment", "most engines kept per replica of a deployment", 1_024, type=int)
    _add(serve, "--limits.bytes", "most bytes of exposition and JSON state all deployments take", 128 << 20, type=int)
    _add(
        serve,
        "--expiry.missed-heartbeats",
        "a replica that promised heartbeats expires after missing this many",
        3,
        type=int,
    )
    _add(serve, "--storage.path", "SQLite file that keeps every accepted ready response", str(default_storage_path()))
    _add(serve, "--cache-config.file", "JSON, TOML or YAML file with the base cache config of every deployment")
    _add(serve, "--metric.prefix", "prefix of the cache_config_* metric names ('vllm:' gives vLLM's names)", "")
    _add(serve, "--log.level", "log level", "info", choices=LOG_LEVELS)

    push = commands.add_parser("push", help="send a ready response (.msgpack or .json file) to a running exporter")
    push.add_argument("file", type=Path, help="the ready response ('-' or /dev/stdin: standard input)")
    _add(
        push,
        "--format",
        "wire format of FILE; auto: JSON for a '.json' file name, msgpack otherwise",
        "auto",
        choices=PUSH_FORMATS,
    )
    _add(
        push,
        "--url",
        "base URL of the exporter, or several separated by commas or spaces (each gets the response)",
        f"http://127.0.0.1:{DEFAULT_PORT}",
    )
    _add(push, "--deployment", "deployment the engine belongs to", "default")
    _add(push, "--replica", "the vLLM server of the deployment the engine belongs to", "default")
    _add(push, "--engine", "engine index, for payloads without data_parallel_rank", type=int)
    _add(push, "--token-file", "file with the exporter's ingest bearer token")
    _add(
        push, "--timeout", "seconds to wait for the exporter (as the vLLM plugin)", DEFAULT_TIMEOUT_SECONDS, type=float
    )
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        listen_address=args.web_listen_address,
        telemetry_path=args.web_telemetry_path,
        storage_path=Path(args.storage_path),
        cache_config_file=_path(args.cache_config_file),
        metric_prefix=args.metric_prefix,
        log_level=args.log_level,
        workers=args.web_workers,
        ingest_token_file=_path(args.web_ingest_token_file),
        allow_unauthenticated_ingest=args.web_allow_unauthenticated_ingest,
        metrics_token_file=_path(args.web_metrics_token_file),
        metrics_basic_auth_file=_path(args.web_metrics_basic_auth_file),
        tls_cert_file=_path(args.web_tls_cert_file),
        tls_key_file=_path(args.web_tls_key_file),
        web_config_file=_path(args.web_config_file),
        max_request_bytes=args.web_max_request_bytes,
        read_timeout_seconds=args.web_read_timeout,
        max_connections=args.web_max_connections,
        max_deployments=args.limits_deployments,
        max_replicas_per_deployment=args.limits_replicas_per_deployment,
        max_engines_per_deployment=args.limits_engines_per_deployment,
        max_bytes=args.limits_bytes,
        max_header_bytes=args.web_max_header_bytes,
        header_timeout_seconds=args.web_header_timeout,
        shutdown_timeout_seconds=args.web_shutdown_timeout,
        allowed_hosts=allowed_hosts(args.web_allowed_hosts, split_listen_address(args.web_listen_address)[0]),
        missed_heartbeats=args.expiry_missed_heartbeats,
    )


def _exit_cleanly(signum: int, frame: object) -> None:
    """SIGTERM outside uvicorn's own handler: at start-up, or re-raised by uvicorn after its graceful shutdown."""
    raise SystemExit(0)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from exporter.request_guard import GuardedHttpToolsProtocol
    from exporter.security import Credentials, ReloadingTls, watched_tls
    from exporter.service import create_app

    # uvicorn drains in-flight requests and runs the lifespan shutdown (queued commits finish) on SIGTERM,
    # then raises the signal again; exit 0 then instead of dying of it.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from(args)
        if settings.workers == 1:
            app: Any = create_app(settings)
        else:
            # Each worker builds its own app; check here what would stop them all.
            Credentials.from_settings(settings)
            settings.base_labels()
            Store(settings.storage_path).close()
            os.environ[SETTINGS_ENVIRONMENT] = settings.to_environment()
            app = "exporter.service:create_app_from_environment"
    except (SettingsError, StorageError) as error:
        print(f"cache-config-exporter: {error}", file=sys.stderr)
        return 2
    host, port = split_listen_address(settings.listen_address)
    # Not "listening" yet: uvicorn logs "Uvicorn running on ..." once the socket is bound, and each worker
    # "Application startup complete" once it accepts; /-/ready answers 200 from then on.
    logging.getLogger("cache_config_exporter").info(
        "starting %d worker(s) on %s, storage %s", settings.workers, settings.listen_address, settings.storage_path
    )
    protocol = functools.partial(
        GuardedHttpToolsProtocol,
        max_header_bytes=settings.max_header_bytes,
        header_timeout=settings.header_timeout_seconds,
    )
    uvicorn.run(
        app,
        http=protocol,  # type: ignore[arg-type]  # a partial of a protocol class, which uvicorn instantiates
        factory=settings.workers > 1,
        workers=settings.workers,
        host=host,
        port=port,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        server_header=False,
        limit_concurrency=settings.max_connections,
        timeout_graceful_shutdown=settings.shutdown_timeout_seconds,  # type: ignore[arg-type]  # float works
        ssl_context_factory=ReloadingTls(settings) if watched_tls(settings) is not None else None,
    )
    return 0


def push(args: argparse.Namespace) -> int:
    try:
        body = sys.stdin.buffer.read() if str(args.file) == "-" else args.file.read_bytes()
        if not body:
            print(
                f"cache-config-exporter push: {args.file} is empty: there is no ready response to send", file=sys.stderr
            )
            return 2
        wire_format = (
            args.format if args.format != "auto" else "json" if args.file.suffix.lower() == ".json" else "msgpack"
        )
        headers = {"Content-Type": PUSH_FORMATS[wire_format]}
        if args.token_file:
            headers["Authorization"] = f"Bearer {read_secret('--token-file', Path(args.token_file))}"
    except OSError as error:
        print(f"cache-config-exporter push: {args.file}: {error.strerror}", file=sys.stderr)
        return 2
    except SettingsError as error:
        print(f"cache-config-exporter push: {error}", file=sys.stderr)
        return 2
    urls = args.url.replace(",", " ").split()
    failed = 0
    for url in urls:
        failed += _push_one(args, url.rstrip("/"), body, headers, named=len(urls) > 1)
    return 1 if failed else 0


def _push_one(args: argparse.Namespace, url: str, body: bytes, headers: dict[str, str], named: bool) -> int:
    """Send the response to one exporter and print what it shows; 1 when it failed."""
    prefix = f"{url}: " if named else ""
    query = urllib.parse.urlencode(
        {"replica": args.replica, **({"engine": args.engine} if args.engine is not None else {})}
    )
    deployment = urllib.parse.quote(args.deployment, safe="/")
    request = urllib.request.Request(
        f"{url}/api/v1/deployments/{deployment}/ready?{query}", data=body, method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            state = json.load(response)
    except urllib.error.HTTPError as error:
        detail = error.read().decode("utf-8", "replace")
        print(f"cache-config-exporter push: {prefix}HTTP {error.code}: {detail}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, TimeoutError, ValueError) as error:
        print(f"cache-config-exporter push: cannot reach {url}: {error}", file=sys.stderr)
        return 1
    labels = state["labels"]
    print(
        f"{prefix}deployment {state['deployment']}: {len(state['engines'])} engine(s), "
        f"block_size={labels['block_size']} mamba_block_size={labels['mamba_block_size']} "
        f"num_gpu_blocks={labels['num_gpu_blocks']}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return serve(args) if args.command == "serve" else push(args)
