"""No accepted input can make ``/metrics`` unparsable: label names and values sent on every route that takes them
(a ready response's own ``cache_config_info`` and ``PUT .../cache-config``), checked by promtool and by
prometheus_client's parser, before and after a restart on the same SQLite file (the real ASGI app)."""

from __future__ import annotations

import string
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from protocol import releases
from tests.helpers.figures import record
from tests.helpers.prometheus import promtool
from tests.helpers.release_payloads import engine_labels, ready_payload

MSGPACK = {"Content-Type": "application/vnd.msgpack"}
NEWEST = releases()[-1]


def check_exposition(client: TestClient) -> str:
    """The exposition, after promtool and prometheus_client both parsed it whole.

    promtool exits 1 on a parse error and 3 on lint advice alone (a person's ``camelCase`` label is advice).
    """
    text = client.get("/metrics").text
    checked = promtool("check", "metrics", stdin=text.encode())
    assert checked.returncode in (0, 3) and "error while linting" not in checked.stderr, checked.stderr
    list(text_string_to_metric_families(text))
    return text


def test_promtool_reports_an_unparsable_exposition() -> None:
    """The oracle itself: a label name ending in a newline is what broke every scrape."""
    checked = promtool("check", "metrics", stdin=b'a_info{evil\n="1"} 1\n')
    assert checked.returncode != 0 and "expected '=' after label name" in checked.stdout + checked.stderr


@pytest.mark.parametrize("name", ["evil\n", "engine\n", "a\nb", "__x", "9a", "a-b"])
def test_a_bad_label_name_is_refused_on_every_route_and_changes_nothing(client: TestClient, name: str) -> None:
    before = check_exposition(client)
    labels = engine_labels(NEWEST, **{name: "x"})
    posted = client.post("/api/v1/deployments/d/ready", content=ready_payload(NEWEST, cache_config_info=labels),
                         headers=MSGPACK)  # fmt: skip
    put = client.put("/api/v1/deployments/d/cache-config", content=msgspec.json.encode({name: "x"}),
                     headers={"Content-Type": "application/json"})  # fmt: skip
    for refused, field in ((posted, f"$.cache_config_info.{name}"), (put, f"$.{name}")):
        assert refused.status_code == 422 and refused.headers["content-type"] == "application/problem+json"
        assert field in refused.text or msgspec.json.encode(field).decode()[1:-1] in refused.text, refused.text
    assert client.get("/api/v1/deployments").json() == []
    assert check_exposition(client).count("cache_config_info{") == before.count("cache_config_info{") == 0


@pytest.mark.parametrize(("label", "value"), [("mamba_cache_mode", "x"), ("block_size", "0")])
def test_the_responses_own_sync_inputs_get_the_checks_put_applies(client: TestClient, label: str, value: str) -> None:
    labels = engine_labels(NEWEST, **{label: value})
    posted = client.post("/api/v1/deployments/d/ready", content=ready_payload(NEWEST, cache_config_info=labels),
                         headers=MSGPACK)  # fmt: skip
    assert posted.status_code == 422 and f"$.cache_config_info.{label}" in posted.text
    assert client.get("/api/v1/deployments").json() == []


# Valid names, and names as close to valid as can be: letters, digits and _ with the characters that break an
# exposition line (a newline at the end among them).
label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,11}", fullmatch=True) | st.text(
    alphabet=string.ascii_letters + string.digits + '_\n\r "=,{}', min_size=1, max_size=12
)
label_values = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)


def test_random_accepted_labels_keep_metrics_parsable_also_after_a_restart(
    make_client: Callable[..., TestClient], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    client = make_client()
    accepted = sent = 0

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(labels=st.dictionaries(label_names, label_values, max_size=4), route=st.sampled_from(["ready", "put"]))
    def check(labels: dict[str, str], route: str) -> None:
        nonlocal accepted, sent
        if route == "ready":
            payload = ready_payload(NEWEST, cache_config_info={**engine_labels(NEWEST), **labels})
            answer = client.post("/api/v1/deployments/d/ready?replica=r", content=payload, headers=MSGPACK)
        else:
            answer = client.put("/api/v1/deployments/d/cache-config?replica=r", content=msgspec.json.encode(labels),
                                headers={"Content-Type": "application/json"})  # fmt: skip
        assert answer.status_code in (200, 422), answer.text
        accepted += answer.status_code == 200
        sent += 1
        check_exposition(client)

    check()
    record(record_property, "random_label_maps", sent=sent, accepted=accepted, refused=sent - accepted)
    assert accepted > 0
    client.__exit__(None, None, None)
    assert "cache_config_info{" in check_exposition(make_client(storage_path=tmp_path / "exporter.db"))
