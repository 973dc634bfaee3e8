"""Where a scrape is rendered (``Exposition.is_small``): a fleet whose last rendered lines were up to
``INLINE_RENDER_BYTES`` on the event loop, once caught up with the heartbeats heard; one byte more in a worker
thread. The body is the same either way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from exporter.exposition import rendering
from tests.helpers.http import MSGPACK
from tests.helpers.ready_responses import ready_response


def on_the_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def rendered_where(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int, int]]:
    """Each render: whether on the event loop, the length of the lines last rendered before it (-1: none), and of
    those it rendered."""
    renders: list[tuple[bool, int, int]] = []
    render = rendering.Exposition.render

    def recorded(self: rendering.Exposition, *arguments: object) -> tuple[Iterable[bytes], int, str]:
        before = self._rendered.last()
        answer = render(self, *arguments)  # type: ignore[arg-type]
        after = self._rendered.last()
        assert after is not None
        renders.append((on_the_loop(), -1 if before is None else before.lines.length, after.lines.length))
        return answer

    monkeypatch.setattr(rendering.Exposition, "render", recorded)
    return renders


@pytest.mark.parametrize("past_the_bound", [0, 1])
def test_a_fleet_at_the_bound_is_rendered_on_the_loop_and_one_byte_past_it_in_a_thread(
    client: TestClient,
    rendered_where: list[tuple[bool, int, int]],
    monkeypatch: pytest.MonkeyPatch,
    past_the_bound: int,
) -> None:
    pushed = client.post("/api/v1/deployments/small/ready?replica=r&heartbeat=30", content=ready_response(0, 1, 1),
                         headers=MSGPACK)  # fmt: skip
    assert pushed.status_code == 200
    first = client.get("/metrics")
    assert first.status_code == 200
    [(on_loop, before, length)] = rendered_where
    assert not on_loop and before == -1  # nothing rendered yet: in a thread
    monkeypatch.setattr(rendering, "INLINE_RENDER_BYTES", length - past_the_bound)
    heard_at = time.time()
    heard = client.post("/api/v1/deployments/small/heartbeat?replica=r&interval=30")
    assert heard.status_code == 204  # heard, not yet in the state: the scrape catches up first
    scraped = client.get("/metrics")
    assert scraped.status_code == 200
    assert rendered_where[-1][:2] == (not past_the_bound, length)
    assert last_seen(scraped.text) >= heard_at > last_seen(first.text)


def last_seen(text: str) -> float:
    """The replica's last-seen time in an exposition."""
    [seen] = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
              if sample.name.endswith("last_seen_timestamp_seconds")]  # fmt: skip
    return seen
