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
``outbox``'s; this module holds the threads and vLLM's side.

In the engine-core process, ``engine_groups`` adds the engine's
own KV-cache groups to the ready response it builds, so they arrive here with it.

A clean shutdown of vLLM says goodbye, once per replica. A server with one API server says it while vLLM shuts
its client down (``MPClient.shutdown`` is wrapped too), or else at the exit of the process
(``atexit`` in a main process, multiprocessing's exit function in its children). A server with several
(``--api-server-count``, or a dense model's data parallelism) says it from vLLM's main process once it has
stopped them (``api_servers``). Nothing ever raises into vLLM, and a goodbye holds vLLM's shutdown at most
``GOODBYE_SECONDS``; none goes to an exporter that was away.

Imports only the standard library and ``protocol`` (with msgspec, vLLM's own dependency, which vLLM loaded
before any plugin), and vLLM only once vLLM calls in, so that loading the plugin costs next to nothing where it
is switched off.
"""

from __future__ import annotations

import functools
import importlib
import logging
import multiprocessing.util
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from exporter.vllm_plugin import api_servers, sender
from exporter.vllm_plugin.delivery import GOODBYE_SECONDS, Delivery
from exporter.vllm_plugin.outbox import Update
from exporter.vllm_plugin.target import Target, deployment_of, replica_of

# Of the exit finalizers of ``multiprocessing``, which run in its child processes too, the goodbye runs first:
# it waits at most ``GOODBYE_SECONDS``, where pools and queues after it may wait for other processes.
GOODBYE_EXIT_PRIORITY = 100
# Set on the wrapper: marks the method as patched and lets tests reach its forwarder.
FORWARDER_ATTRIBUTE = "cache_config_exporter_forwarder"

logger = logging.getLogger("vllm.cache_config_exporter")


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
            deployment = deployment_of(getattr(client, "vllm_config", None), self._target.deployment)
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
        """At vLLM's exit: every exporter forgets this replica at once, and nothing more is sent (``begin_goodbye``);
        waits for it at most ``GOODBYE_SECONDS``."""
        self.begin_goodbye()()

    def begin_goodbye(self) -> Callable[[], None]:
        """At vLLM's clean shutdown: start saying goodbye to every exporter and return what waits for it, at most
        ``GOODBYE_SECONDS`` from now in all, so that vLLM's own teardown runs meanwhile.

        Once per process, only in the process that forwards, and not in an API server whose parent says it; no
        goodbye goes to an exporter that holds nothing of this server or did not answer its last attempt.
        """
        if self._goodbye_pid != os.getpid() or self._said_goodbye:
            # A forked child inherits the forwarder, not the server: it must not remove the parent's replica.
            return _nothing_to_wait_for
        self._said_goodbye = True
        if api_servers.parent_says_goodbye():
            # No more heartbeats: vLLM's main process says the goodbye once this process is gone.
            for delivery in self.deliveries:
                delivery.close()
            return _nothing_to_wait_for
        return _waiting_for([delivery.close_with_goodbye() for delivery in self.deliveries])

    def goodbye_for_api_servers(self, vllm_config: object) -> None:
        """In vLLM's main process, once its API servers are gone: the goodbye they leave to it, for the deployment
        ``vllm_config`` names as theirs does. Once; waits at most ``GOODBYE_SECONDS``."""
        if self._said_goodbye:
            return
        self._said_goodbye = True
        goodbye = sender.goodbye_call(deployment_of(vllm_config, self._target.deployment), self.replica)
        # Nothing was offered here, so no delivery thread ever ran: one thread per exporter says the goodbye.
        threads = [
            threading.Thread(target=delivery.leave, args=([goodbye],), daemon=True) for delivery in self.deliveries
        ]
        wait = _waiting_for(threads)
        for delivery, thread in zip(self.deliveries, threads, strict=True):
            delivery.close()
            thread.start()
        wait()

    def close(self) -> None:
        """Stop every delivery thread after its request in flight, without goodbye (for tests)."""
        if self._goodbye_at_exit is not None:
            self._goodbye_at_exit.cancel()
        for thread in [delivery.close() for delivery in self.deliveries]:
            if thread is not None:
                thread.join()


def _nothing_to_wait_for() -> None:
    """No goodbye goes."""


def _waiting_for(threads: Sequence[threading.Thread | None]) -> Callable[[], None]:
    """What waits for the goodbye ``threads`` together, until ``GOODBYE_SECONDS`` from now: a hanging exporter
    delays no one."""
    deadline = time.monotonic() + GOODBYE_SECONDS

    def wait() -> None:
        for thread in threads:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    return wait


def _alongside(shutdown: Callable[..., Any], begin_goodbye: Callable[[], Callable[[], None]]) -> Callable[..., Any]:
    """A ``shutdown`` method of vLLM's during which the goodbye goes: begun before vLLM's own teardown, waited for
    after it, also when that raised (vLLM's error stays vLLM's). A teardown longer than the goodbye's deadline
    leaves nothing to wait for."""

    @functools.wraps(shutdown)
    def shutdown_with_goodbye(self: Any, *args: Any, **kwargs: Any) -> Any:
        wait = begin_goodbye()
        try:
            return shutdown(self, *args, **kwargs)
        finally:
            wait()

    return shutdown_with_goodbye


def _forwarding(original: Callable[..., Any], forwarder: Forwarder) -> Callable[..., Any]:
    """``MPClient._apply_ready_response`` that hands each response vLLM applied to ``forwarder``."""

    @functools.wraps(original)
    def _apply_ready_response(self: Any, payload: bytes, *args: Any, **kwargs: Any) -> Any:
        result = original(self, payload, *args, **kwargs)
        forwarder.submit(self, payload)
        return result

    setattr(_apply_ready_response, FORWARDER_ATTRIBUTE, forwarder)
    return _apply_ready_response


def register() -> None:
    """Entry point of ``vllm.general_plugins``: wrap the frontend's ready-response handler and shutdown once.

    Does nothing at all without ``CACHE_CONFIG_EXPORTER_URL``; a vLLM without
    the handler gets a warning and is left untouched.
    """
    target = Target.from_environment()
    if target is None:
        return
    # In the engine core: its KV-cache groups ride on its ready response (msgspec, vLLM's own, loads only here).
    from exporter.vllm_plugin import engine_groups as vllm_engine_groups

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
        # An API server shuts its client down as it stops, and may be killed right after, before any exit handler.
        client_class.shutdown = _alongside(shutdown, forwarder.begin_goodbye)
    api_servers.install(forwarder.goodbye_for_api_servers)
    # In vLLM's API server this runs before vLLM sets up its log handler, so the line shows in the
    # engine core's and workers' log; the frontend logs the deployment's line with its first payload.
    logger.info("cache-config-exporter: forwarding ready responses to %s", ", ".join(target.urls))
