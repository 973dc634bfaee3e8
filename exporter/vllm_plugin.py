"""A vLLM general plugin that forwards every engine's ready response from vLLM's frontend to the exporter.

vLLM calls ``register()`` (entry point group ``vllm.general_plugins``) in its
frontend, in every engine core process and in every worker, possibly several
times per process. It wraps ``vllm.v1.engine.core_client.MPClient._apply_ready_response``
once. Only the frontend ever calls that method, so patching the class in the
other processes is harmless; telling the frontend apart by process name or
parentage would be fragile (several API server processes, Ray, forking
launchers), whereas the method runs exactly where the payloads arrive.

The wrapper runs vLLM's method first and unchanged, then only queues the
bytes with the frontend's ``cache_config.metrics_info()`` (the labels of vLLM's
own ``vllm:cache_config_info``, exactly as vLLM renders them): one daemon thread
PUTs that map whenever it changed since it was last sent, then POSTs the payload
unchanged, in order, with a short timeout and bounded retries. A failure logs
one warning and never reaches vLLM, and vLLM's start-up never waits for the
exporter.

Imports only the standard library, and vLLM only inside ``register()``, so
that loading the plugin costs nothing where it is switched off.
"""

from __future__ import annotations

import functools
import http.client
import importlib
import json
import logging
import os
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from exporter import __version__

URL_VARIABLE = "CACHE_CONFIG_EXPORTER_URL"
DEPLOYMENT_VARIABLE = "CACHE_CONFIG_EXPORTER_DEPLOYMENT"
TOKEN_FILE_VARIABLE = "CACHE_CONFIG_EXPORTER_TOKEN_FILE"
TOKEN_VARIABLE = "CACHE_CONFIG_EXPORTER_TOKEN"
# The same variable as ``cache-config-exporter push --timeout``.
TIMEOUT_VARIABLE = "CACHE_CONFIG_EXPORTER_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 2.0
# Waits between attempts: four attempts per request, then one warning.
RETRY_DELAYS_SECONDS = (0.5, 1.0, 2.0)
# Answers that may change on their own; any other refusal (401, 422, ...) is final at once.
RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
# One payload per engine and start; far more than any data-parallel size is never kept.
MAX_QUEUED = 1024
# Set on the wrapper: marks the method as patched and lets tests reach its forwarder.
FORWARDER_ATTRIBUTE = "cache_config_exporter_forwarder"
# RFC 7230 visible characters: anything else could break the header (and land in an error message).
_BEARER_TOKEN = re.compile(r"[!-~]+")
_USER_AGENT = f"cache-config-exporter-vllm-plugin/{__version__}"
# The exporter's deployment names: ``/``-separated segments, at most this long.
_NAME_SEGMENT_START = re.compile(r"[^A-Za-z0-9_]")
_NAME_SEGMENT_REST = re.compile(r"[^A-Za-z0-9_.:@+-]")
MAX_DEPLOYMENT_LENGTH = 200
DEFAULT_DEPLOYMENT = "default"
# A served model name that is a path, not a name: ``vllm serve /models/llama`` without ``--served-model-name``.
_PATH_PREFIXES = ("/", "./", "../", "~")

# A child of vLLM's own logger, so that messages appear in vLLM's log with its format.
logger = logging.getLogger("vllm.cache_config_exporter")


@dataclass(frozen=True)
class Target:
    """Where and how to send, from the environment of the vLLM process."""

    url: str
    deployment: str | None = None
    token_file: str | None = None
    # Kept out of repr(): the token must never reach a log or a traceback.
    token: str | None = field(default=None, repr=False)
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Target | None:
        """``None`` when ``CACHE_CONFIG_EXPORTER_URL`` is unset or empty: the plugin is off."""
        url = environ.get(URL_VARIABLE, "").strip().rstrip("/")
        if not url:
            return None
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            logger.warning("cache-config-exporter: %s=%r is not an http(s) URL; not forwarding", URL_VARIABLE, url)
            return None
        return cls(
            url=url,
            deployment=environ.get(DEPLOYMENT_VARIABLE, "").strip() or None,
            token_file=environ.get(TOKEN_FILE_VARIABLE, "").strip() or None,
            token=environ.get(TOKEN_VARIABLE, "").strip() or None,
            timeout_seconds=_timeout(environ.get(TIMEOUT_VARIABLE)),
        )


def _timeout(value: str | None) -> float:
    if value is None:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0.0 < seconds < float("inf"):
        logger.warning(
            "cache-config-exporter: %s=%r is not a positive number of seconds; using %s",
            TIMEOUT_VARIABLE,
            value,
            DEFAULT_TIMEOUT_SECONDS,
        )
        return DEFAULT_TIMEOUT_SECONDS
    return seconds


class _Job(NamedTuple):
    deployment: str
    config: dict[str, str]
    payload: bytes


class _DeliveryFailed(Exception):
    """A job that cannot be delivered; the message says why and is fit for the log."""


class _ConfigRefused(Exception):
    """The exporter refused one field of the static config; the ready response still goes."""

    def __init__(self, field_name: str, detail: str) -> None:
        super().__init__(f"{field_name}: {detail}")
        self.field_name = field_name
        self.detail = detail


def fit_deployment_name(name: str) -> str:
    """``name`` made to fit the exporter's rule: every character it does not allow becomes ``_``."""
    segments = [segment for segment in name.split("/") if segment]
    fitted = "/".join(
        _NAME_SEGMENT_START.sub("_", segment[0]) + _NAME_SEGMENT_REST.sub("_", segment[1:]) for segment in segments
    )
    return fitted[:MAX_DEPLOYMENT_LENGTH].rstrip("/") or DEFAULT_DEPLOYMENT


def deployment_of(client: object, configured: str | None) -> str:
    """The configured deployment, else vLLM's (first) served model name, else ``default``, fit for the exporter.

    A model served by path is named after the path's last component: the whole
    path says where the files lie on one machine, not what is served.
    """
    if configured:
        return fit_deployment_name(configured)
    model_config = getattr(getattr(client, "vllm_config", None), "model_config", None)
    name = getattr(model_config, "served_model_name", None)
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    if not isinstance(name, str) or not name:
        return DEFAULT_DEPLOYMENT
    if name.startswith(_PATH_PREFIXES):
        name = os.path.basename(os.path.normpath(os.path.abspath(os.path.expanduser(name))))
    return fit_deployment_name(name)


def static_config_of(client: object) -> dict[str, str]:
    """The frontend's ``cache_config.metrics_info()``: vLLM's own labels, as vLLM renders them."""
    return dict(client.vllm_config.cache_config.metrics_info())  # type: ignore[attr-defined]


class Forwarder:
    """Sends queued ready responses to the exporter from one daemon thread, in arrival order."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self._condition = threading.Condition()
        # The job being delivered stays at the head until it is done, so ``flush`` waits for it too.
        self._jobs: deque[_Job] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        # Per deployment, the config last sent (accepted or refused): PUT again only when it changed.
        self._sent_configs: dict[str, dict[str, str]] = {}
        self._named: set[str] = set()
        self._refusals: set[tuple[str, str]] = set()
        self._failing = False
        self._token: str | None = None

    def submit(self, client: object, payload: bytes) -> None:
        """Queue ``payload`` with ``client``'s deployment and static config; never blocks, never raises.

        An empty payload (what engines before 0.20 send first) carries nothing to forward.
        """
        if not payload:
            return
        try:
            job = _Job(deployment_of(client, self._target.deployment), static_config_of(client), bytes(payload))
        except Exception as error:
            self._report(f"cannot read the ready response or vLLM's config: {error!r}")
            return
        if job.deployment not in self._named:
            self._named.add(job.deployment)
            logger.info(
                "cache-config-exporter: forwarding the ready responses of deployment %r to %s",
                job.deployment,
                self._target.url,
            )
        with self._condition:
            if self._closed:
                return
            if len(self._jobs) >= MAX_QUEUED:
                self._report(f"{MAX_QUEUED} ready responses are still waiting; dropping one")
                return
            self._jobs.append(job)
            # ``is_alive`` is False in a child forked after the thread started.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="cache-config-exporter", daemon=True)
                self._thread.start()
            self._condition.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued payload is delivered or given up; False on timeout."""
        with self._condition:
            return self._condition.wait_for(lambda: not self._jobs or self._closed, timeout)

    def close(self) -> None:
        """Stop the thread after the request in flight, dropping the rest (for tests and clean shutdowns)."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._jobs or self._closed)
                if self._closed:
                    return
                job = self._jobs[0]
            try:
                self._deliver(job)
            except _DeliveryFailed as failure:
                self._report(str(failure))
            except Exception as error:
                self._report(f"unexpected error: {error!r}")
            else:
                self._recovered()
            with self._condition:
                self._jobs.popleft()
                self._condition.notify_all()

    def _deliver(self, job: _Job) -> None:
        """PUT the deployment's static config if it changed, then POST the payload: labels match vLLM's throughout."""
        headers = self._authorization()
        deployment = urllib.parse.quote(job.deployment, safe="/")
        if self._sent_configs.get(job.deployment) != job.config:
            body = json.dumps(job.config).encode()
            try:
                self._send("PUT", f"/api/v1/deployments/{deployment}/cache-config", body, "application/json", headers)
            except _ConfigRefused as refusal:
                self._refused(job.deployment, refusal)
            self._sent_configs[job.deployment] = job.config
        self._send("POST", f"/api/v1/deployments/{deployment}/ready", job.payload, "application/vnd.msgpack", headers)

    def _refused(self, deployment: str, refusal: _ConfigRefused) -> None:
        """One warning per refused field and reason: the value is neither dropped silently nor converted."""
        if (refusal.field_name, refusal.detail) in self._refusals:
            return
        self._refusals.add((refusal.field_name, refusal.detail))
        logger.warning(
            "cache-config-exporter: the exporter refused the cache config of %r because of field %r: %s. "
            "Its ready responses are still forwarded, but the exporter does not show this field as vLLM has it.",
            deployment,
            refusal.field_name,
            refusal.detail,
        )

    def _authorization(self) -> dict[str, str]:
        """The bearer header, from the token file (read afresh, so it may rotate) or the token variable."""
        token = self._target.token
        if self._target.token_file:
            try:
                with open(self._target.token_file, encoding="utf-8") as file:
                    token = file.read().strip()
            except (OSError, UnicodeDecodeError) as error:
                raise _DeliveryFailed(f"cannot read {TOKEN_FILE_VARIABLE} {self._target.token_file}: {error}") from None
        if not token:
            return {}
        self._token = token
        if not _BEARER_TOKEN.fullmatch(token):
            raise _DeliveryFailed("the token has characters a bearer token cannot have (whitespace or non-ASCII)")
        return {"Authorization": f"Bearer {token}"}

    def _send(self, method: str, path: str, body: bytes, content_type: str, headers: dict[str, str]) -> None:
        """One request, retried with backoff while the exporter may recover.

        Raises ``_ConfigRefused`` when a PUT is refused for one field, else ``_DeliveryFailed``.
        """
        url = f"{self._target.url}{path}"
        request = urllib.request.Request(
            url, data=body, method=method, headers={"Content-Type": content_type, "User-Agent": _USER_AGENT}
        )
        for name, value in headers.items():
            # Unredirected: a redirect to another host never carries the token.
            request.add_unredirected_header(name, value)
        delays = (*RETRY_DELAYS_SECONDS, None)
        for delay in delays:
            try:
                with urllib.request.urlopen(request, timeout=self._target.timeout_seconds) as response:
                    response.read()
                return
            except urllib.error.HTTPError as error:
                with error:
                    problem = _problem(error)
                detail = problem.get("detail")
                reason = f"HTTP {error.code}: {str(detail)[:200]}" if detail else f"HTTP {error.code}"
                if method == "PUT" and 400 <= error.code < 500 and problem.get("field"):
                    raise _ConfigRefused(str(problem["field"]), str(detail)[:200]) from None
                if error.code not in RETRY_STATUSES:
                    raise _DeliveryFailed(f"{method} {url}: {reason}") from None
            except (OSError, http.client.HTTPException) as error:
                reason = str(getattr(error, "reason", None) or error)
            if delay is None or self._stopping(delay):
                break
        raise _DeliveryFailed(f"{method} {url}: {reason} (after {len(delays)} attempts)")

    def _stopping(self, delay: float) -> bool:
        """Back off for ``delay`` seconds; True at once when the forwarder is closed."""
        with self._condition:
            return self._condition.wait_for(lambda: self._closed, delay)

    def _report(self, message: str) -> None:
        """One warning per outage: the first failure warns, the next ones are debug until a send succeeds."""
        if self._token:
            message = message.replace(self._token, "<token>")
        with self._condition:
            failing, self._failing = self._failing, True
        if failing:
            logger.debug("cache-config-exporter: %s", message)
            return
        logger.warning(
            "cache-config-exporter: %s. vLLM is not affected, but the exporter will not show this deployment's "
            "true cache config; further failures are logged at debug level until a send succeeds.",
            message,
        )

    def _recovered(self) -> None:
        with self._condition:
            failing, self._failing = self._failing, False
        if failing:
            logger.info("cache-config-exporter: %s is reachable again", self._target.url)


def _problem(error: urllib.error.HTTPError) -> dict[str, Any]:
    """The exporter's problem document (``detail``, and ``field`` for a refused field), or an empty one."""
    try:
        problem = json.loads(error.read(4096))
    except (OSError, ValueError):
        return {}
    return problem if isinstance(problem, dict) else {}


def _wrap(original: Callable[..., Any], forwarder: Forwarder) -> Callable[..., Any]:
    @functools.wraps(original)
    def _apply_ready_response(self: Any, payload: bytes, *args: Any, **kwargs: Any) -> Any:
        result = original(self, payload, *args, **kwargs)
        forwarder.submit(self, payload)
        return result

    setattr(_apply_ready_response, FORWARDER_ATTRIBUTE, forwarder)
    return _apply_ready_response


def register() -> None:
    """Entry point of ``vllm.general_plugins``: wrap the frontend's ready-response handler once.

    Does nothing at all without ``CACHE_CONFIG_EXPORTER_URL``; a vLLM without
    the handler gets a warning and is left untouched.
    """
    target = Target.from_environment()
    if target is None:
        return
    try:
        core_client = importlib.import_module("vllm.v1.engine.core_client")
    except Exception as error:
        logger.warning("cache-config-exporter: cannot import vllm.v1.engine.core_client (%r); not forwarding", error)
        return
    client_class = getattr(core_client, "MPClient", None)
    original = getattr(client_class, "_apply_ready_response", None)
    if not callable(original):
        logger.warning(
            "cache-config-exporter: this vLLM has no MPClient._apply_ready_response; not forwarding ready responses"
        )
        return
    if hasattr(original, FORWARDER_ATTRIBUTE):
        return
    client_class._apply_ready_response = _wrap(original, Forwarder(target))
    # In vLLM's API server this runs before vLLM sets up its log handler, so the line shows in the
    # engine core's and workers' log; the frontend logs the deployment's line with its first payload.
    logger.info("cache-config-exporter: forwarding ready responses to %s", target.url)
