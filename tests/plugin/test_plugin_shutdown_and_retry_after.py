"""The plugin's delivery thread against stand-in exporters (tests/plugin/standins.py): ``Retry-After`` honoured
with heartbeats resuming after it, and a goodbye that holds vLLM's shutdown at most ``GOODBYE_SECONDS``, whatever
the exporter does."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from exporter.vllm_plugin import delivery
from exporter.vllm_plugin.delivery import GOODBYE_SECONDS
from tests.helpers.figures import record
from tests.plugin import standins
from tests.plugin import test_vllm_plugin as plugin_tests
from tests.plugin.standins import StandIn
from tests.plugin.test_vllm_plugin import pristine, vllm_package  # noqa: F401  (fixtures)
from tests.support import wait_until

# What vLLM's shutdown may be held by the goodbye, with what a loaded 2-core machine adds to its deadline.
HELD_AT_MOST_SECONDS = 0.5
GOODBYE = "DELETE /api/v1/deployments/org/hybrid?replica=r1 "


@pytest.mark.slow  # two waits of 2 s
def test_retry_after_spaces_every_request_and_what_is_due_goes_as_soon_as_the_wait_ends(
    monkeypatch: pytest.MonkeyPatch, stand_in: Callable[..., StandIn]
) -> None:
    """The backoff is milliseconds here (``pristine``): only ``Retry-After`` spaces the requests by seconds."""
    shedding = standins.retry_after("2")

    def sheds_twice(server: StandIn, connection: Any) -> bool:
        return (shedding if len(server.requests()) <= 2 else standins.ok)(server, connection)

    server = stand_in(sheds_twice)
    plugin_tests.plugin_on(monkeypatch, server.url, replica="r1", heartbeat_seconds="1")
    client = plugin_tests.frontend()
    client._apply_ready_response(plugin_tests.ready_response())
    wait_until(lambda: len(server.requests()) >= 2, timeout=10)
    # A newer ready response arrives during the second wait; the exporter takes what comes after it.
    client._apply_ready_response(plugin_tests.ready_response(num_gpu_blocks=4000))
    assert plugin_tests.forwarder().flush(10)
    # Heartbeats resume after the wait.
    wait_until(lambda: any("/heartbeat?" in arrival.line for arrival in server.requests()), timeout=10)

    arrivals = server.requests()
    gaps = [later.at - earlier.at for earlier, later in itertools.pairwise(arrivals[:3])]
    # Each 429 asked for 2 s, counted from its answer, which came after its request arrived.
    assert min(gaps) >= 2.0, gaps
    # The labels that were refused, then the newest labels and ready response, at once after the second wait.
    assert [arrival.line.split("?")[0] for arrival in arrivals[:4]] == [
        "PUT /api/v1/deployments/org/hybrid/cache-config",
        "PUT /api/v1/deployments/org/hybrid/cache-config",
        "PUT /api/v1/deployments/org/hybrid/cache-config",
        "POST /api/v1/deployments/org/hybrid/ready",
    ]
    assert gaps[1] < 2.0 + 1.0


def delivered_then(
    monkeypatch: pytest.MonkeyPatch, stand_in: Callable[..., StandIn], behaviour: Callable[..., bool]
) -> tuple[StandIn, Any]:
    """A running frontend whose state the stand-in took; the stand-in then answers with ``behaviour``."""
    monkeypatch.setattr(delivery, "BATCH_WINDOW_SECONDS", 0.0)  # one engine: nothing to gather
    server = stand_in()
    plugin_tests.plugin_on(monkeypatch, server.url, replica="r1")
    client = plugin_tests.running(plugin_tests.frontend())
    client._apply_ready_response(plugin_tests.ready_response())
    assert plugin_tests.forwarder().flush(10)
    server.behaviour = behaviour
    return server, client


@pytest.mark.parametrize("name", list(standins.HOSTILE))
def test_the_goodbye_holds_vllms_shutdown_half_a_second_at_most_whatever_the_exporter_does(
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    stand_in: Callable[..., StandIn],
    record_property: Callable[[str, object], None],
) -> None:
    """The timeout is 30 s here (``plugin_on``): the goodbye has its own deadline."""
    server, client = delivered_then(monkeypatch, stand_in, standins.HOSTILE[name])
    started = time.monotonic()
    client.shutdown()
    held = time.monotonic() - started
    record(record_property, f"plugin goodbye against {name}", held_seconds=round(held, 3))
    # The goodbye went, and vLLM's own shutdown ran.
    assert server.requests("DELETE")[0].line.startswith(GOODBYE)
    assert client.resources.cleanups == 1
    assert held < HELD_AT_MOST_SECONDS
    if name != "endless":  # an answer past the cap ends the goodbye at once; the others run out its deadline
        assert held >= GOODBYE_SECONDS * 0.9


def test_no_goodbye_to_an_exporter_that_never_answered_and_no_wait_for_it(
    monkeypatch: pytest.MonkeyPatch, stand_in: Callable[..., StandIn]
) -> None:
    monkeypatch.setattr(delivery, "BATCH_WINDOW_SECONDS", 0.0)  # one engine: nothing to gather
    server = stand_in(standins.blackhole)
    plugin_tests.plugin_on(monkeypatch, server.url, replica="r1")
    client = plugin_tests.running(plugin_tests.frontend())
    client._apply_ready_response(plugin_tests.ready_response())
    # The labels are in the blackhole, their request in flight for its 30 s timeout.
    wait_until(lambda: server.requests(), timeout=10)
    started = time.monotonic()
    client.shutdown()
    held = time.monotonic() - started
    # Holds nothing of this server: nothing to say goodbye to, nothing to wait for.
    assert held < GOODBYE_SECONDS / 2
    assert server.requests("DELETE") == []


class TearingDown:
    """vLLM's engine manager, whose shutdown ends once the stand-in has the goodbye (at most 5 s): a goodbye that
    went only after vLLM's teardown would hold it 5 s."""

    def __init__(self, server: StandIn) -> None:
        self.server = server
        self.goodbye_during_teardown = False

    def shutdown(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + 5
        arrived = threading.Event()
        while time.monotonic() < deadline and not self.server.requests("DELETE"):
            arrived.wait(0.01)
        self.goodbye_during_teardown = bool(self.server.requests("DELETE"))


def test_the_goodbye_goes_while_vllm_tears_down(
    monkeypatch: pytest.MonkeyPatch, stand_in: Callable[..., StandIn]
) -> None:
    server, client = delivered_then(monkeypatch, stand_in, standins.blackhole)
    client.resources.engine_manager = manager = TearingDown(server)
    started = time.monotonic()
    client.shutdown()
    held = time.monotonic() - started
    assert manager.goodbye_during_teardown
    # The teardown and the goodbye's deadline overlap.
    assert held < 1.0
