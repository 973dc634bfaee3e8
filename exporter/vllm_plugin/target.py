"""Where this vLLM server sends and as whom: the exporters' URLs, the token and the timings from the
environment of the vLLM process, and the deployment and replica names derived from vLLM's config."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from exporter.vllm_plugin import sender
from protocol.names import (
    DEFAULT_DEPLOYMENT,
    MAX_HEARTBEAT_SECONDS,
    MIN_HEARTBEAT_SECONDS,
    deployment_of_model,
    fit_deployment_name,
    fit_replica_name,
)

URL_VARIABLE = "CACHE_CONFIG_EXPORTER_URL"
DEPLOYMENT_VARIABLE = "CACHE_CONFIG_EXPORTER_DEPLOYMENT"
REPLICA_VARIABLE = "CACHE_CONFIG_EXPORTER_REPLICA"
HEARTBEAT_VARIABLE = "CACHE_CONFIG_EXPORTER_HEARTBEAT_SECONDS"
TOKEN_FILE_VARIABLE = "CACHE_CONFIG_EXPORTER_TOKEN_FILE"
TOKEN_VARIABLE = "CACHE_CONFIG_EXPORTER_TOKEN"
# The same variable as ``cache-config-exporter push --timeout``.
TIMEOUT_VARIABLE = "CACHE_CONFIG_EXPORTER_TIMEOUT"
DEFAULT_HEARTBEAT_SECONDS = 30.0
# vLLM's API server port when ``--port`` is not given.
VLLM_DEFAULT_PORT = "8000"

# A child of vLLM's own logger, so that messages appear in vLLM's log with its format.
logger = logging.getLogger("vllm.cache_config_exporter")


@dataclass(frozen=True)
class Target:
    """Where and how to send, from the environment of the vLLM process."""

    urls: tuple[str, ...]
    deployment: str | None = None
    replica: str | None = None
    token_file: str | None = None
    # Kept out of repr(): the token must never reach a log or a traceback.
    token: str | None = field(default=None, repr=False)
    timeout_seconds: float = sender.DEFAULT_TIMEOUT_SECONDS
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Target | None:
        """``None`` when ``CACHE_CONFIG_EXPORTER_URL`` holds no http(s) URL: the plugin is off."""
        urls = _urls(environ.get(URL_VARIABLE, ""))
        if not urls:
            return None
        return cls(
            urls=urls,
            deployment=environ.get(DEPLOYMENT_VARIABLE, "").strip() or None,
            replica=environ.get(REPLICA_VARIABLE, "").strip() or None,
            token_file=environ.get(TOKEN_FILE_VARIABLE, "").strip() or None,
            token=environ.get(TOKEN_VARIABLE, "").strip() or None,
            timeout_seconds=_seconds(
                TIMEOUT_VARIABLE,
                environ.get(TIMEOUT_VARIABLE),
                sender.DEFAULT_TIMEOUT_SECONDS,
                lambda seconds: 0.0 < seconds < math.inf,
                "a positive number of seconds",
            ),
            heartbeat_seconds=_seconds(
                HEARTBEAT_VARIABLE,
                environ.get(HEARTBEAT_VARIABLE),
                DEFAULT_HEARTBEAT_SECONDS,
                lambda seconds: MIN_HEARTBEAT_SECONDS <= seconds <= MAX_HEARTBEAT_SECONDS,
                f"a number of seconds from {MIN_HEARTBEAT_SECONDS:g} to {MAX_HEARTBEAT_SECONDS:g}",
            ),
        )


def _urls(value: str) -> tuple[str, ...]:
    """The distinct http(s) URLs of a comma- or space-separated list; each other entry gets a warning."""
    urls: list[str] = []
    for url in sender.split_urls(value):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            logger.warning(
                "cache-config-exporter: %s holds %r, not an http(s) URL; not forwarding to it", URL_VARIABLE, url
            )
        elif url not in urls:
            urls.append(url)
    return tuple(urls)


def _seconds(variable: str, value: str | None, default: float, valid: Callable[[float], bool], expected: str) -> float:
    """``value`` as seconds when ``valid``; else ``default``, with a warning saying what was ``expected``."""
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if valid(seconds):
        return seconds
    logger.warning("cache-config-exporter: %s=%r is not %s; using %s", variable, value, expected, default)
    return default


def api_port(argv: Sequence[str]) -> str:
    """The port of vLLM's API server as its command line gives it (``--port N``, ``--port=N``), else vLLM's default."""
    port = VLLM_DEFAULT_PORT
    for index, argument in enumerate(argv):
        if argument == "--port" and index + 1 < len(argv):
            port = argv[index + 1]
        elif argument.startswith("--port="):
            port = argument.partition("=")[2]
    return port


def replica_of(configured: str | None, argv: Sequence[str] | None = None, host: str | None = None) -> str:
    """The configured replica name, else ``<host name>:<API port>``: what tells this vLLM server apart, fit to send.

    Stable across restarts of the same server; in Kubernetes the host name is the pod's name.
    """
    if configured:
        return fit_replica_name(configured)
    port = api_port(sys.argv if argv is None else argv)
    return fit_replica_name(f"{host if host is not None else socket.gethostname()}:{port}")


def deployment_of(vllm_config: object, configured: str | None) -> str:
    """The configured deployment, else the (first) served model name of ``vllm_config``, vLLM's ``VllmConfig``,
    else ``default``, fit for the exporter.

    A model served by path is named after the path's last component: the whole
    path says where the files lie on one machine, not what is served.
    """
    if configured:
        return fit_deployment_name(configured)
    model_config = getattr(vllm_config, "model_config", None)
    name = getattr(model_config, "served_model_name", None)
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    if not isinstance(name, str) or not name:
        return DEFAULT_DEPLOYMENT
    return deployment_of_model(name)
