"""The ``cache-config-exporter`` command: ``serve`` runs the exporter, ``push`` sends it a ready response.

Every flag can also come from an environment variable, named after the flag:
``--web.listen-address`` is ``CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from exporter import __version__
from exporter.settings import DEFAULT_PORT, Settings, SettingsError, default_storage_path, split_listen_address
from exporter.storage import StorageError

ENV_PREFIX = "CACHE_CONFIG_EXPORTER_"
LOG_LEVELS = ("debug", "info", "warning", "error")


def env_name(flag: str) -> str:
    """``--web.listen-address`` -> ``CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS``."""
    return ENV_PREFIX + flag.lstrip("-").replace(".", "_").replace("-", "_").upper()


def _add(parser: argparse.ArgumentParser, flag: str, help_text: str, default: object = None, **kwargs: object) -> None:
    """A flag whose default comes from its environment variable, then from ``default``."""
    variable = env_name(flag)
    parser.add_argument(
        flag,
        dest=variable.removeprefix(ENV_PREFIX).lower(),
        default=os.environ.get(variable, default),
        help=f"{help_text} (env {variable}; default: %(default)s)",
        **kwargs,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cache-config-exporter",
        description="Prometheus exporter of the KV-cache configuration vLLM engines really run with.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the exporter")
    _add(
        serve, "--web.listen-address", "HOST:PORT to listen on (:PORT for every interface)", f"127.0.0.1:{DEFAULT_PORT}"
    )
    _add(serve, "--web.telemetry-path", "path of the metrics", "/metrics")
    _add(serve, "--storage.path", "SQLite file that keeps every accepted ready response", str(default_storage_path()))
    _add(serve, "--cache-config.file", "JSON, TOML or YAML file with the base cache config of every deployment")
    _add(serve, "--metric.prefix", "prefix of the cache_config_* metric names ('vllm:' gives vLLM's names)", "")
    _add(serve, "--log.level", "log level", "info", choices=LOG_LEVELS)

    push = commands.add_parser("push", help="send a ready response (.msgpack or .json file) to a running exporter")
    push.add_argument("file", type=Path, help="the ready response; '.json' files are sent as JSON, others as msgpack")
    _add(push, "--url", "base URL of the exporter", f"http://127.0.0.1:{DEFAULT_PORT}")
    _add(push, "--deployment", "deployment the engine belongs to", "default")
    _add(push, "--engine", "engine index, for payloads without data_parallel_rank", type=int)
    _add(push, "--timeout", "seconds to wait for the exporter", 10.0, type=float)
    return parser


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from exporter.service import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings(
            listen_address=args.web_listen_address,
            telemetry_path=args.web_telemetry_path,
            storage_path=Path(args.storage_path),
            cache_config_file=Path(args.cache_config_file) if args.cache_config_file else None,
            metric_prefix=args.metric_prefix,
            log_level=args.log_level,
        )
        app = create_app(settings)
    except (SettingsError, StorageError) as error:
        print(f"cache-config-exporter: {error}", file=sys.stderr)
        return 2
    host, port = split_listen_address(settings.listen_address)
    logging.getLogger("cache_config_exporter").info(
        "listening on %s, storage %s, metrics at %s",
        settings.listen_address,
        settings.storage_path,
        settings.telemetry_path,
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        server_header=False,
    )
    return 0


def push(args: argparse.Namespace) -> int:
    try:
        body = args.file.read_bytes()
    except OSError as error:
        print(f"cache-config-exporter push: {args.file}: {error.strerror}", file=sys.stderr)
        return 2
    content_type = "application/json" if args.file.suffix.lower() == ".json" else "application/vnd.msgpack"
    deployment = urllib.parse.quote(args.deployment, safe="/")
    url = f"{args.url.rstrip('/')}/api/v1/deployments/{deployment}/ready"
    if args.engine is not None:
        url += f"?engine={args.engine}"
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            state = json.load(response)
    except urllib.error.HTTPError as error:
        detail = error.read().decode("utf-8", "replace")
        print(f"cache-config-exporter push: HTTP {error.code}: {detail}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, TimeoutError) as error:
        print(f"cache-config-exporter push: cannot reach {args.url}: {error}", file=sys.stderr)
        return 1
    labels = state["labels"]
    print(
        f"deployment {state['deployment']}: {len(state['engines'])} engine(s), block_size={labels['block_size']} "
        f"mamba_block_size={labels['mamba_block_size']} num_gpu_blocks={labels['num_gpu_blocks']}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return serve(args) if args.command == "serve" else push(args)
