"""A vLLM server of several API servers says its goodbye once, from vLLM's main process, after they are gone.

``vllm serve --api-server-count N`` (by default the data-parallel size of a dense model) runs N API-server
processes under a main process that starts and stops them (vLLM 0.32: ``run_multi_api_server`` with
``vllm.v1.utils.APIServerProcessManager``). Each API server forwards the same replica. On SIGTERM the main
process stops them with ``APIServerProcessManager.shutdown``: SIGTERM, then SIGKILL once ``--shutdown-timeout``
(0 by default) has passed, which leaves an API server's own goodbye a race.

The main process outlives its API servers and loads the plugin too (vLLM loads its general plugins while it
parses its arguments), so it says the goodbye itself as soon as they are gone: after them, no heartbeat of
theirs can bring the replica back. Before starting them it sets ``GOODBYE_BY_VARIABLE`` to its own pid, which
they inherit, and an API server whose parent says the goodbye says none: one goodbye per replica.

The main process applies no ready response, so it names the deployment as its API servers do: from the config
it made with ``EngineArgs.create_engine_config``, from the same arguments as theirs. A vLLM without these
names keeps the API servers' own goodbyes.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

# Set by vLLM's main process, inherited by the API servers it starts: the pid of the process that says goodbye.
GOODBYE_BY_VARIABLE = "CACHE_CONFIG_EXPORTER_GOODBYE_BY"

logger = logging.getLogger("vllm.cache_config_exporter")


def parent_says_goodbye() -> bool:
    """True in an API server whose parent, vLLM's main process, says the goodbye for the whole server."""
    return os.environ.get(GOODBYE_BY_VARIABLE) == str(os.getppid())


def install(say_goodbye: Callable[[object], None]) -> None:
    """In every process of vLLM: wrap what only vLLM's main process calls, so that once its API servers are gone
    it calls ``say_goodbye`` with the ``VllmConfig`` it made last (``None`` if it made none)."""
    engine_args = _attribute("vllm.engine.arg_utils", "EngineArgs")
    manager = _attribute("vllm.v1.utils", "APIServerProcessManager")
    create_engine_config = getattr(engine_args, "create_engine_config", None)
    shutdown = getattr(manager, "shutdown", None)
    if not (callable(create_engine_config) and callable(shutdown)):
        logger.debug("cache-config-exporter: no APIServerProcessManager here; each API server says its own goodbye")
        return
    made: list[object] = [None]
    engine_args.create_engine_config = _remembering(create_engine_config, made)
    manager.__init__ = _leaving_goodbye_to_this_process(manager.__init__)
    manager.shutdown = followed_by(shutdown, lambda: say_goodbye(made[0]))


def _attribute(module_name: str, name: str) -> Any:
    """``module_name.name`` of this vLLM, ``None`` where it has none."""
    try:
        return getattr(importlib.import_module(module_name), name, None)
    except Exception as error:
        logger.debug("cache-config-exporter: cannot import %s (%r)", module_name, error)
        return None


def _remembering(original: Callable[..., Any], made: list[object]) -> Callable[..., Any]:
    """``EngineArgs.create_engine_config`` that keeps the config it returns in ``made``."""

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        made[0] = config = original(self, *args, **kwargs)
        return config

    return create_engine_config


def _leaving_goodbye_to_this_process(original: Callable[..., Any]) -> Callable[..., Any]:
    """``APIServerProcessManager.__init__``, which starts the API servers, telling them this process says goodbye."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        os.environ[GOODBYE_BY_VARIABLE] = str(os.getpid())
        original(self, *args, **kwargs)

    return __init__


def followed_by(shutdown: Callable[..., Any], say_goodbye: Callable[[], None]) -> Callable[..., Any]:
    """A ``shutdown`` method of vLLM's that says goodbye once vLLM's own shutdown is over, also when that raised:
    vLLM's error stays vLLM's, and the goodbye goes all the same."""

    @functools.wraps(shutdown)
    def shutdown_then_goodbye(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return shutdown(self, *args, **kwargs)
        finally:
            say_goodbye()

    return shutdown_then_goodbye
