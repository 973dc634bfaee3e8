"""A vLLM general plugin that keeps every exporter told what this vLLM server's engines really run with.

vLLM calls ``register()`` (entry point group ``vllm.general_plugins``) in its
frontend, in every engine core process and in every worker, possibly several
times per process. It wraps ``vllm.v1.engine.core_client.MPClient._apply_ready_response``
once. Only the frontend ever calls that method, so patching the class in the
other processes is harmless; telling the frontend apart by process name or
parentage would be fragile (several API server processes, Ray, forking
launchers), whereas the method runs exactly where the payloads arrive.

The wrapper runs vLLM's method first and unchanged, then hands the bytes, with
the frontend's ``cache_config.metrics_info()`` (the labels of vLLM's own
``vllm:cache_config_info``, exactly as vLLM renders them), to one daemon thread
per exporter URL, so that an exporter away never delays another. This vLLM
server is one *replica* of its deployment, named after its host and API port.
Each thread keeps only what its exporter must end up holding: the newest
static labels and the newest ready response of each engine of the current run
(a new ``instance_id`` drops the previous run's). It delivers them, labels
first, the ready responses its engines report within a second of each other
as one request (a DP=8 server's start is one request and one commit),
retrying with capped exponential backoff until they are delivered or
superseded, so an exporter away for any length of time loses nothing and
memory stays bounded by the number of engines. Once delivered, a small
heartbeat keeps the replica alive; a heartbeat the exporter does not know
(a new or restarted exporter) sends the whole state again. Those rules are
``exporter/plugin_outbox.py``'s; this module holds the threads and vLLM's side.

In the engine-core process, ``exporter/vllm_engine_groups.py`` adds the engine's
own KV-cache groups to the ready response it builds, so they arrive here with it.

A clean shutdown of vLLM says goodbye as soon as vLLM has shut its client down
(``MPClient.shutdown`` is wrapped too): each API-server process of
``--api-server-count`` or data parallelism does that as it stops, and vLLM's
main process may kill them right after, before any exit handler. Otherwise the
exit of the process says it (``atexit`` in the main process, multiprocessing's
exit function in its children). Nothing ever raises into vLLM or waits for an
exporter.

Imports only the standard library and the project's modules that do too, and
vLLM (with its msgspec) only once vLLM calls in, so that loading the plugin
costs nothing where it is switched off.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import multiprocessing.util
import os
import re
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from exporter import sender
from exporter.plugin_outbox import Attempt, Backoff, Outbox, Update, Verdict, outcomes_of, verdict_of

URL_VARIABLE = "CACHE_CONFIG_EXPORTER_URL"
DEPLOYMENT_VARIABLE = "CACHE_CONFIG_EXPORTER_DEPLOYMENT"
REPLICA_VARIABLE = "CACHE_CONFIG_EXPORTER_REPLICA"
HEARTBEAT_VARIABLE = "CACHE_CONFIG_EXPORTER_HEARTBEAT_SECONDS"
TOKEN_FILE_VARIABLE = "CACHE_CONFIG_EXPORTER_TOKEN_FILE"
TOKEN_VARIABLE = "CACHE_CONFIG_EXPORTER_TOKEN"
# The same variable as ``cache-config-exporter push --timeout``.
TIMEOUT_VARIABLE = "CACHE_CONFIG_EXPORTER_TIMEOUT"
DEFAULT_HEARTBEAT_SECONDS = 30.0
# The heartbeat intervals the exporter accepts.
MIN_HEARTBEAT_SECONDS = 1.0
MAX_HEARTBEAT_SECONDS = 86400.0
# Backoff while an exporter is away (``plugin_outbox.Backoff``): doubling from the first wait up to the cap, and
# never beyond one heartbeat interval, so that an exporter that is back has the whole state within one interval.
FIRST_RETRY_SECONDS = 0.5
MAX_RETRY_SECONDS = 30.0
# The engines of a data-parallel server report within moments of each other as they start: what they report
# within this window of the first goes in one request.
BATCH_WINDOW_SECONDS = 1.0
# Of the exit finalizers of ``multiprocessing``, which run in its child processes too, the goodbye runs first:
# it waits at most the timeout, where pools and queues after it may wait for other processes.
GOODBYE_EXIT_PRIORITY = 100
# vLLM's API server port when ``--port`` is not given.
VLLM_DEFAULT_PORT = "8000"
# Set on the wrapper: marks the method as patched and lets tests reach its forwarder.
FORWARDER_ATTRIBUTE = "cache_config_exporter_forwarder"
# The exporter's names: a deployment is ``/``-separated segments, a replica one segment; each at most 200 long.
_NAME_SEGMENT_START = re.compile(r"[^A-Za-z0-9_]")
_NAME_SEGMENT_REST = re.compile(r"[^A-Za-z0-9_.:@+-]")
MAX_NAME_LENGTH = 200
DEFAULT_DEPLOYMENT = "default"
DEFAULT_REPLICA = "default"
# A served model name that is a path, not a name: ``vllm serve /models/llama`` without ``--served-model-name``.
_PATH_PREFIXES = ("/", "./", "../", "~")

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


def _fit_segment(segment: str) -> str:
    return _NAME_SEGMENT_START.sub("_", segment[0]) + _NAME_SEGMENT_REST.sub("_", segment[1:])


def fit_deployment_name(name: str) -> str:
    """``name`` made to fit the exporter's rule: every character it does not allow becomes ``_``."""
    fitted = "/".join(_fit_segment(segment) for segment in name.split("/") if segment)
    return fitted[:MAX_NAME_LENGTH].rstrip("/") or DEFAULT_DEPLOYMENT


def fit_replica_name(name: str) -> str:
    """``name`` made to fit the exporter's rule for a replica (one segment, ``/`` too becomes ``_``)."""
    return _fit_segment(name)[:MAX_NAME_LENGTH] if name else DEFAULT_REPLICA


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
    return deployment_of_model(name)


def deployment_of_model(name: str) -> str:
    """A served model name as a deployment: a path by its last component, fit for the exporter.

    Shared with the probe, which reads the name from vLLM's ``model_name`` label, so both modes name a server alike.
    """
    if name.startswith(_PATH_PREFIXES):
        name = os.path.basename(os.path.normpath(os.path.abspath(os.path.expanduser(name))))
    return fit_deployment_name(name)


def static_config_of(client: object) -> dict[str, str]:
    """The frontend's ``cache_config.metrics_info()``: vLLM's own labels, as vLLM renders them."""
    return dict(client.vllm_config.cache_config.metrics_info())  # type: ignore[attr-defined]


def engine_and_run(payload: bytes) -> tuple[int, str | None]:
    """A ready response's engine index and run (``instance_id``), read as the exporter reads them."""
    import msgspec  # vLLM's own dependency, loaded by vLLM's frontend long before

    message = msgspec.msgpack.decode(payload)
    if not isinstance(message, dict):
        return 0, None
    rank, run = message.get("data_parallel_rank"), message.get("instance_id")
    engine = rank if isinstance(rank, int) and not isinstance(rank, bool) else 0
    return engine, run if isinstance(run, str) and run else None


class Delivery:
    """Delivers one replica's state to one exporter from its own daemon thread, until delivered or superseded.

    What is due when, and what an answer means, is the ``Outbox``'s; this holds the thread, the lock, the clock
    and the log.
    """

    def __init__(self, url: str, target: Target) -> None:
        self.url = url
        self._target = target
        self._condition = threading.Condition()
        backoff = Backoff(FIRST_RETRY_SECONDS, MAX_RETRY_SECONDS, target.heartbeat_seconds)
        self._outbox = Outbox(target.heartbeat_seconds, backoff, BATCH_WINDOW_SECONDS)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._goodbye = False
        self._refusals: set[tuple[str, str]] = set()
        self._token: str | None = None
        # The delivery thread's alone: the plugin's heartbeats reuse one connection.
        self._connection = sender.Connection(url, target.timeout_seconds, client="vllm-plugin")

    def offer(self, update: Update) -> None:
        """Take ``update`` as the newest state of its engine (and labels); never blocks on the exporter."""
        with self._condition:
            if self._closed:
                return
            self._outbox.offer(update, time.monotonic())
            # ``is_alive`` is False in a child forked after the thread started.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"cache-config-exporter {self.url}", daemon=True)
                self._thread.start()
            self._condition.notify_all()

    def backlog(self) -> int:
        """How many items (labels, ready responses) this exporter has still to take."""
        with self._condition:
            return self._outbox.backlog()

    def flush(self, timeout: float) -> bool:
        """Wait until this exporter holds everything offered; False on timeout."""
        with self._condition:
            return self._condition.wait_for(lambda: self._closed or not self._outbox.backlog(), timeout)

    def close(self, goodbye: bool = False) -> threading.Thread | None:
        """Stop after the request in flight, with ``goodbye`` first removing the replicas the exporter holds."""
        with self._condition:
            self._closed = True
            self._goodbye = goodbye
            self._condition.notify_all()
            return self._thread

    def _run(self) -> None:
        """The thread: make each request once it is due and record what came of it, until closed."""
        while (attempt := self._next_attempt()) is not None:
            outcome = self._send(attempt.call)
            with self._condition:
                failing = self._outbox.failing
                verdict = self._outbox.record(attempt, outcome, time.monotonic())
                self._condition.notify_all()
            self._log(attempt, outcome, verdict, failing)
        if self._goodbye:
            self._say_goodbye()
        self._connection.close()

    def _next_attempt(self) -> Attempt | None:
        """The next request to make, once it is due; ``None`` when closed."""
        with self._condition:
            while not self._closed:
                due = self._outbox.due(time.monotonic())
                if isinstance(due, Attempt):
                    return due
                self._condition.wait(None if due == math.inf else due)
        return None

    def _log(self, attempt: Attempt, outcome: sender.Outcome, verdict: Verdict, failing: bool) -> None:
        """What came of ``attempt`` (``failing`` since an earlier one), in vLLM's log."""
        # Of several ready responses, the first one not taken says why.
        outcome = next(
            (item for item in outcomes_of(attempt, outcome) if verdict_of(attempt, item) is verdict), outcome
        )
        if verdict is Verdict.LABELS_REFUSED and isinstance(outcome, sender.Refused):
            self._refused(attempt.deployment, outcome)
        elif verdict in (Verdict.RETRY, Verdict.REFUSED):
            self._report(self._described(attempt.call, outcome), first=not failing)
        elif verdict is Verdict.SPLIT:
            logger.info(
                "cache-config-exporter: %s refused %d ready responses in one request (%s); sending one a request",
                self.url,
                len(attempt.versions),
                outcome,
            )
        else:
            if verdict is Verdict.NOT_HELD:
                logger.info(
                    "cache-config-exporter: %s does not hold replica %r of %r; sending its state again",
                    self.url,
                    attempt.replica,
                    attempt.deployment,
                )
            if failing:
                logger.info("cache-config-exporter: %s is reachable again", self.url)

    def _say_goodbye(self) -> None:
        """Remove this server's replicas from the exporter: vLLM is shutting down cleanly. One attempt each."""
        with self._condition:
            calls = self._outbox.goodbyes()
        for call in calls:
            outcome = self._send(call)
            if not isinstance(outcome, sender.Accepted):
                logger.debug(
                    "cache-config-exporter: goodbye failed: %s", self._redacted(self._described(call, outcome))
                )

    def _send(self, call: sender.Call) -> sender.Outcome:
        """One request, with the token as it is now; a token that cannot be sent counts as unreachable."""
        try:
            authorization = self._authorization()
        except sender.TokenError as error:
            return sender.Unreachable(str(error))
        return self._connection.send(call, authorization=authorization)

    def _described(self, call: sender.Call, outcome: sender.Outcome) -> str:
        """What came of ``call``, for the log: the request, then the answer."""
        return f"{call.method} {self.url}{call.path}: {outcome}"

    def _authorization(self) -> str | None:
        """The bearer header, from the token file (read afresh, so it may rotate) or the token variable."""
        token = self._target.token
        if self._target.token_file:
            try:
                token = sender.read_token(self._target.token_file)
            except sender.TokenError as error:
                raise sender.TokenError(f"cannot read {TOKEN_FILE_VARIABLE} {error}") from None
        if not token:
            return None
        self._token = token
        return sender.bearer(token)

    def _refused(self, deployment: str, refusal: sender.Refused) -> None:
        """One warning per refused field and reason: the value is neither dropped silently nor converted."""
        if (refusal.field or "", refusal.detail) in self._refusals:
            return
        self._refusals.add((refusal.field or "", refusal.detail))
        logger.warning(
            "cache-config-exporter: %s refused the cache config of %r because of field %r: %s. "
            "Its ready responses are still forwarded, but the exporter does not show this field as vLLM has it.",
            self.url,
            deployment,
            refusal.field,
            refusal.detail,
        )

    def _redacted(self, message: str) -> str:
        return message.replace(self._token, "<token>") if self._token else message

    def _report(self, message: str, first: bool) -> None:
        """One warning per outage: the ``first`` failure warns, the next ones are debug until a send succeeds."""
        message = self._redacted(message)
        if not first:
            logger.debug("cache-config-exporter: %s", message)
            return
        logger.warning(
            "cache-config-exporter: %s. vLLM is not affected; the newest state of this vLLM server is kept and "
            "retried until the exporter takes it; further failures are logged at debug level until a send succeeds.",
            message,
        )


class Forwarder:
    """Hands each applied ready response to one ``Delivery`` per exporter URL."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self.replica = replica_of(target.replica)
        self.deliveries = [Delivery(url, target) for url in target.urls]
        self._named: set[str] = set()
        # The process that forwards (its first ready response arms the goodbye): only it says goodbye, once.
        self._goodbye_pid: int | None = None
        self._goodbye_at_exit: multiprocessing.util.Finalize | None = None
        self._said_goodbye = False

    def submit(self, client: object, payload: bytes) -> None:
        """Offer ``payload`` with ``client``'s deployment and labels to every exporter; never blocks, never raises.

        An empty payload (what engines before 0.20 send first) carries nothing to forward.
        """
        if not payload:
            return
        try:
            engine, run = engine_and_run(payload)
            deployment = deployment_of(client, self._target.deployment)
            update = Update(deployment, self.replica, static_config_of(client), engine, run, bytes(payload))
        except Exception as error:
            logger.warning("cache-config-exporter: cannot read the ready response or vLLM's config: %r", error)
            return
        if deployment not in self._named:
            self._named.add(deployment)
            logger.info(
                "cache-config-exporter: forwarding the ready responses of deployment %r as replica %r to %s",
                deployment,
                self.replica,
                ", ".join(self._target.urls),
            )
        if self._goodbye_pid is None:
            self._goodbye_pid = os.getpid()
            # Run at exit through ``atexit`` in a main process, and by multiprocessing itself in its children:
            # a forked one leaves through ``os._exit``, where ``atexit`` handlers never run.
            self._goodbye_at_exit = multiprocessing.util.Finalize(
                None, self.goodbye, exitpriority=GOODBYE_EXIT_PRIORITY
            )
        for delivery in self.deliveries:
            delivery.offer(update)

    def backlog(self) -> dict[str, int]:
        """Per exporter URL, how many items it has still to take."""
        return {delivery.url: delivery.backlog() for delivery in self.deliveries}

    def flush(self, timeout: float) -> bool:
        """Wait until every exporter holds everything offered; False on timeout."""
        deadline = time.monotonic() + timeout
        return all(delivery.flush(max(0.0, deadline - time.monotonic())) for delivery in self.deliveries)

    def goodbye(self) -> None:
        """At vLLM's clean shutdown or exit: every exporter forgets this replica at once, and nothing more is sent.

        Once per process, only in the process that forwards; waits at most the timeout in all.
        """
        if self._goodbye_pid != os.getpid() or self._said_goodbye:
            # A forked child inherits the forwarder, not the server: it must not remove the parent's replica.
            return
        self._said_goodbye = True
        threads = [delivery.close(goodbye=True) for delivery in self.deliveries]
        deadline = time.monotonic() + self._target.timeout_seconds
        for thread in threads:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop every delivery thread after its request in flight, without goodbye (for tests)."""
        if self._goodbye_at_exit is not None:
            self._goodbye_at_exit.cancel()
        for thread in [delivery.close() for delivery in self.deliveries]:
            if thread is not None:
                thread.join()


def _forwarding(original: Callable[..., Any], forwarder: Forwarder) -> Callable[..., Any]:
    """``MPClient._apply_ready_response`` that hands each response vLLM applied to ``forwarder``."""

    @functools.wraps(original)
    def _apply_ready_response(self: Any, payload: bytes, *args: Any, **kwargs: Any) -> Any:
        result = original(self, payload, *args, **kwargs)
        forwarder.submit(self, payload)
        return result

    setattr(_apply_ready_response, FORWARDER_ATTRIBUTE, forwarder)
    return _apply_ready_response


def _saying_goodbye(original: Callable[..., Any], forwarder: Forwarder) -> Callable[..., Any]:
    """``MPClient.shutdown`` that says goodbye once vLLM's own shutdown is over (also when that raised).

    Each API-server process of a vLLM server shuts its client down as it stops; vLLM's main process may kill
    it right after (``--shutdown-timeout`` 0), before any exit handler runs.
    """

    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            forwarder.goodbye()

    return shutdown


def register() -> None:
    """Entry point of ``vllm.general_plugins``: wrap the frontend's ready-response handler and shutdown once.

    Does nothing at all without ``CACHE_CONFIG_EXPORTER_URL``; a vLLM without
    the handler gets a warning and is left untouched.
    """
    target = Target.from_environment()
    if target is None:
        return
    # In the engine core: its KV-cache groups ride on its ready response (msgspec, vLLM's own, loads only here).
    from exporter import vllm_engine_groups

    vllm_engine_groups.install()
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
    forwarder = Forwarder(target)
    client_class._apply_ready_response = _forwarding(original, forwarder)
    shutdown = getattr(client_class, "shutdown", None)
    if callable(shutdown):
        client_class.shutdown = _saying_goodbye(shutdown, forwarder)
    # In vLLM's API server this runs before vLLM sets up its log handler, so the line shows in the
    # engine core's and workers' log; the frontend logs the deployment's line with its first payload.
    logger.info("cache-config-exporter: forwarding ready responses to %s", ", ".join(target.urls))
