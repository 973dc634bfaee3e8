"""The ``cache-config-exporter`` command: ``serve`` runs the exporter, ``push`` sends it a ready response.

Every flag can also come from an environment variable, named after the flag:
``--web.listen-address`` is ``CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS``.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import resource
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exporter import __version__
from exporter.config.settings import SETTINGS_ENVIRONMENT, Settings, add_options, serve_options, settings_from
from exporter.exposition.shared_counts import SHARED_COUNTS_ENVIRONMENT, create_shared_counts
from exporter.exposition.telemetry import MULTIPROCESS_ENVIRONMENT
from exporter.flags.option import Option, SettingsError
from exporter.security.addresses import split_listen_address
from exporter.security.options import DEFAULT_PORT
from exporter.state.owner import own
from exporter.state.storage import SqliteStore, StorageError
from exporter.vllm_plugin import sender
from protocol import tokens

PUSH_FORMATS = ("auto", *sender.CONTENT_TYPES)
PUSH_OPTIONS = (
    Option(
        "--format",
        "wire format of FILE; auto: JSON for a '.json' file name, msgpack otherwise",
        "auto",
        choices=PUSH_FORMATS,
    ),
    Option(
        "--url",
        "base URL of the exporter, or several separated by commas or spaces (each gets the response)",
        f"http://127.0.0.1:{DEFAULT_PORT}",
    ),
    Option("--deployment", "deployment the engine belongs to", "default"),
    Option("--replica", "the vLLM server of the deployment the engine belongs to", "default"),
    Option("--engine", "engine index, for payloads without data_parallel_rank", parse=int),
    Option("--token-file", "file with the exporter's ingest bearer token"),
    Option(
        "--timeout",
        "seconds to wait for the exporter (as the vLLM plugin)",
        sender.DEFAULT_TIMEOUT_SECONDS,
        parse=float,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cache-config-exporter",
        description="Prometheus exporter of the KV-cache configuration vLLM engines really run with.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_options(commands.add_parser("serve", help="run the exporter"), list(serve_options().values()))
    push = commands.add_parser("push", help="send a ready response (.msgpack or .json file) to a running exporter")
    push.add_argument("file", type=Path, help="the ready response ('-' or /dev/stdin: standard input)")
    add_options(push, PUSH_OPTIONS)
    return parser


# Descriptors besides connections: SQLite and its WAL, the listening sockets, the log, the watched access files.
SPARE_DESCRIPTORS = 64


def connections_within_descriptors(max_connections: int) -> tuple[int, int]:
    """Raise the soft limit on open files as far as the hard one allows; the connections that then fit
    (each may hold two descriptors: its socket, and a probe's connection to its target), and the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an unlimited hard limit is more than the kernel takes: keep the soft one
            pass
    if soft == resource.RLIM_INFINITY:
        return max_connections, soft
    return max(1, min(max_connections, (soft - SPARE_DESCRIPTORS) // 2)), soft


def _exit_cleanly(signum: int, frame: object) -> None:
    """SIGTERM outside uvicorn's own handler: at start-up, or re-raised by uvicorn after its graceful shutdown."""
    raise SystemExit(0)


def _prepare_workers(settings: Settings) -> str:
    """``serve --web.workers N``: check here what would stop every worker, hand them the settings and the folder
    of their counts; the import path of the app each builds."""
    from exporter.probe.client import MetricsClient
    from exporter.security.auth import Credentials

    Credentials.from_settings(settings)
    MetricsClient.from_settings(settings)
    settings.base_labels()
    if not settings.probe_only:
        SqliteStore(settings.storage_path).close()
    os.environ[SETTINGS_ENVIRONMENT] = settings.to_environment()
    if settings.probe_only:
        # Their probe counts in a memory file: a probe-only exporter may have no writable directory at all.
        os.environ[SHARED_COUNTS_ENVIRONMENT] = create_shared_counts()
    else:
        # The workers count into files here; each one's scrape shows the sums (exposition/telemetry.py).
        os.environ[MULTIPROCESS_ENVIRONMENT] = counters = tempfile.mkdtemp(prefix="cache-config-exporter-")
        atexit.register(shutil.rmtree, counters, ignore_errors=True)
    return "exporter.server.app:create_app_from_environment"


def serve(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Run the exporter with the parsed flags; ``argv``, the command line they came from (to name former flags)."""
    import uvicorn

    from exporter.security.https_listener import ReloadingTls, watched_tls
    from exporter.server.app import create_app
    from exporter.server.gc_freeze import freeze_survivors
    from exporter.server.uvicorn_adapter import HeartbeatAnsweringProtocol

    # uvicorn drains in-flight requests and runs the lifespan shutdown (queued commits finish) on SIGTERM,
    # then raises the signal again; exit 0 then instead of dying of it.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for option in serve_options().values():
        for former, name in option.former_names_used(argv):
            logging.getLogger("cache_config_exporter").warning("%s is read as %s, its new name: use that", former, name)
    try:
        settings = settings_from(args)
        # Held until the process ends: the parent's of --web.workers N too, whose workers share the file.
        owner = None if settings.probe_only else own(settings.storage_path)
        app: Any = create_app(settings) if settings.workers == 1 else _prepare_workers(settings)
    except (SettingsError, StorageError) as error:
        print(f"cache-config-exporter: {error}", file=sys.stderr)
        return 2
    host, port = split_listen_address(settings.listen_address)
    # Not "listening" yet: uvicorn logs "Uvicorn running on ..." once the socket is bound, and each worker
    # "Application startup complete" once it accepts; /-/ready answers 200 from then on.
    kept = "probe only, no storage" if settings.probe_only else f"storage {settings.storage_path}"
    logging.getLogger("cache_config_exporter").info(
        "starting %d worker(s) on %s, %s", settings.workers, settings.listen_address, kept
    )
    max_connections, descriptors = connections_within_descriptors(settings.max_connections)
    if max_connections < settings.max_connections:
        logging.getLogger("cache_config_exporter").warning(
            "--web.max-connections %d does not fit in the open-file limit of %d (ulimit -n, raised as far as the "
            "hard limit allows): at most %d connections are served",
            settings.max_connections, descriptors, max_connections,
        )  # fmt: skip
    protocol = HeartbeatAnsweringProtocol.configured(
        max_header_bytes=settings.max_header_bytes,
        header_timeout=settings.header_timeout_seconds,
        write_timeout=settings.write_timeout_seconds,
        max_connections=max_connections,
        heartbeats=app.state.quick_heartbeats if settings.workers == 1 else None,
    )
    thaw = freeze_survivors()  # so does each worker process of --web.workers N, as it builds its app
    try:
        uvicorn.run(
            app,
            http=protocol,  # type: ignore[arg-type]  # a factory of protocols, which uvicorn calls per connection
            factory=settings.workers > 1,
            workers=settings.workers,
            host=host,
            port=port,
            log_level=settings.log_level,
            access_log=settings.log_level == "debug",
            server_header=False,
            timeout_keep_alive=settings.keep_alive_timeout_seconds,  # type: ignore[arg-type]  # float works
            timeout_graceful_shutdown=settings.shutdown_timeout_seconds,  # type: ignore[arg-type]  # float works
            ssl_context_factory=ReloadingTls(settings) if watched_tls(settings) is not None else None,
        )
    finally:
        thaw()
        if owner is not None:
            owner.release()
    return 0


def push(args: argparse.Namespace) -> int:
    try:
        body = sys.stdin.buffer.read() if str(args.file) == "-" else args.file.read_bytes()
    except OSError as error:
        print(f"cache-config-exporter push: {args.file}: {error.strerror}", file=sys.stderr)
        return 2
    if not body:
        print(f"cache-config-exporter push: {args.file} is empty: there is no ready response to send", file=sys.stderr)
        return 2
    wire_format = args.format if args.format != "auto" else "json" if args.file.suffix.lower() == ".json" else "msgpack"
    authorization = None
    if args.token_file:
        try:
            token = tokens.read_token(args.token_file)
            if not token:
                raise tokens.TokenError("the file is empty")
            authorization = tokens.bearer(token)
        except tokens.TokenError as error:
            print(f"cache-config-exporter push: --token-file {args.token_file}: {error}", file=sys.stderr)
            return 2
    call = sender.ready_call(args.deployment, body, wire_format, args.replica, engine=args.engine)
    urls = sender.split_urls(args.url)
    failed = 0
    for url in urls:
        outcome = sender.send(url, call, args.timeout, authorization=authorization, client="push")
        failed += _report(url if len(urls) > 1 else None, url, outcome)
    return 1 if failed else 0


def _report(name: str | None, url: str, outcome: sender.CallResult) -> int:
    """Print what one exporter shows after the push (prefixed with its ``name`` when there are several);
    1 when it failed."""
    prefix = f"{name}: " if name else ""
    match outcome:
        case sender.Accepted(state={"deployment": deployment, "engines": engines, "labels": labels}):
            print(
                f"{prefix}deployment {deployment}: {len(engines)} engine(s), "
                f"block_size={labels['block_size']} mamba_block_size={labels['mamba_block_size']} "
                f"num_gpu_blocks={labels['num_gpu_blocks']}"
            )
            return 0
        case sender.Rejected():
            message = f"{prefix}{outcome}"
        case sender.Accepted():
            message = f"{prefix}{url} answered, but not with a deployment's synced state"
        case _:
            message = f"cannot reach {url}: {outcome}"
    print(f"cache-config-exporter push: {message}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(arguments)
    return serve(args, arguments) if args.command == "serve" else push(args)
