"""Hostile input, generated and mutated by Hypothesis, through the real HTTP app (ASGI, real SQLite file).

After every request: never a 5xx; a refusal is an application/problem+json 4xx and leaves the stored
state exactly as it was (the JSON API's bytes and a read-only dump of every SQLite row); an acceptance
changes the state consistently (the answer is what the API then shows); and the exposition parses with
prometheus_client's text and OpenMetrics parsers, every ``cache_config_info`` series carrying exactly
``deployment``, ``engine`` and the 31 CacheConfig labels, with the values the API shows: no input can
break the exposition or forge a series. Figures: requests sent, refused (bad inputs) and accepted.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from protocol import releases
from tests.helpers.exposition import OPENMETRICS, cache_config_samples
from tests.helpers.figures import record
from tests.helpers.sqlite_file import read_only, rows
from tests.support import case_names, fixture_bytes

READY_TYPES = ["application/vnd.msgpack", "application/msgpack", "application/x-msgpack", "application/json"]
OTHER_TYPES = [
    "text/plain",
    "application/octet-stream",
    "application/x-www-form-urlencoded",
    "",
    "application/jsonx",
    "multipart/form-data; boundary=x",
    'application/vnd.msgpack; charset="utf-8"',
    "APPLICATION/JSON",
]
DEPLOYMENTS = ["qwen", "Qwen/Qwen3.6-35B-A3B", "dense", "a_b.c:d@e+f-g"]
FIXTURES = [msgspec.msgpack.decode(fixture_bytes(name)) for name in case_names()]
SELF_METRICS = b"# HELP cache_config_exporter_"


class Checked:
    """A client whose every request is checked against the invariants; counts what happened."""

    def __init__(self, client: TestClient, storage: Path) -> None:
        self.client = client
        self.db: sqlite3.Connection = read_only(storage)
        self.counts: Counter[str] = Counter()
        self.state = self._state()
        self.exposition = self._check_exposition()

    def _state(self) -> tuple[bytes, tuple[list[tuple], list[tuple]]]:
        return self.client.get("/api/v1/deployments").content, rows(self.db)

    def _check_exposition(self) -> bytes:
        """Parse both formats and check every series against the API; the cache-config part of the text."""
        text = self.client.get("/metrics")
        openmetrics = self.client.get("/metrics", headers={"Accept": OPENMETRICS})
        assert text.status_code == openmetrics.status_code == 200
        series = cache_config_samples(text.text)
        assert cache_config_samples(openmetrics.text, openmetrics=True) == series
        state = {(item["deployment"], item["replica"]): item for item in json.loads(self.state[0])}
        info = [dict(labels) for name, labels, _ in series if name == "cache_config_info"]
        assert len(info) == sum(len(item["engines"]) for item in state.values())
        for labels in info:
            shown = state[labels.pop("deployment"), labels.pop("replica")]
            assert int(labels.pop("engine")) in {engine["engine"] for engine in shown["engines"]}
            assert labels == shown["labels"]
        return text.content.partition(SELF_METRICS)[0]

    def send(self, method: str, path: str, body: bytes = b"", content_type: str | None = None) -> int:
        headers = {"Content-Type": content_type} if content_type is not None else {}
        response = self.client.request(method, path, content=body, headers=headers)
        status = response.status_code
        self.counts["requests"] += 1
        self.counts["server_errors_5xx"] += status >= 500
        assert status < 500, (status, response.text[:500])
        if status >= 400:
            self.counts["refused"] += 1
            assert response.headers["content-type"] == "application/problem+json", response.headers
            problem = response.json()
            assert problem["status"] == status and problem["title"] and problem["detail"], problem
            changed = self._state() != self.state
            exposition = self.client.get("/metrics").content.partition(SELF_METRICS)[0]
            self.counts["changed_by_refusal"] += changed or exposition != self.exposition
            assert not changed, "a refused request changed the stored state"
            assert exposition == self.exposition, "a refused request changed the exposition"
        else:
            self.counts["accepted"] += 1
            self.state = self._state()
            if method != "DELETE":
                name = response.json()["deployment"]
                assert self.client.get(f"/api/v1/deployments/{quote(name)}").json() == response.json()
            self.exposition = self._check_exposition()
        return status

    def close(self) -> None:
        self.db.close()


@pytest.fixture
def checked(make_client: Callable[..., TestClient], tmp_path: Path) -> Iterator[Checked]:
    checker = Checked(make_client(), tmp_path / "exporter.db")
    yield checker
    checker.close()


def run(checked: Checked, record_property: Callable[[str, object], None], name: str, test: Callable[[], None]) -> None:
    """Run a Hypothesis test; record how many requests it sent and refused."""
    test()
    record(record_property, f"hostile_{name}", **checked.counts)
    assert checked.counts["requests"] > 0


SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
}

# Values --------------------------------------------------------------------------------------------------

huge_numbers = st.sampled_from([2**63 - 1, 2**64 - 1, -(2**63), 2**40 + 1, 2**24 + 1, 2**16, -1, 0])
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([math.nan, math.inf, -math.inf, 1e308])
huge_strings = st.sampled_from([256, 257, 1000, 20_000]).map(lambda n: "x" * n)
# Label-breaking text: quotes, braces, backslashes, newlines, '=' and ',' as in an exposition line.
hostile_text = st.text(alphabet=st.sampled_from('"{}\\\n\r\t,= #aé\u2028\x00'), max_size=40) | huge_strings
scalars = st.none() | st.booleans() | st.integers() | huge_numbers | floats | hostile_text | st.binary(max_size=64)
nested = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hostile_text, inner, max_size=4), max_leaves=20
)


def deep(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


@st.composite
def ready_documents(draw: st.DrawFn) -> dict[str, Any]:
    """A real ready response with some fields replaced, removed or added."""
    document = dict(draw(st.sampled_from(FIXTURES)))
    for key in draw(st.lists(st.sampled_from(sorted(document)), max_size=4, unique=True)):
        if draw(st.booleans()):
            document[key] = draw(nested | st.sampled_from([deep(100), deep(300), {str(i): i for i in range(3000)}]))
        else:
            del document[key]
    for key, value in draw(st.dictionaries(hostile_text, nested, max_size=2)).items():
        document[key] = value
    return document


def encode(document: Any, wire: str) -> bytes:
    """msgpack, or JSON in its Python flavour (NaN and Infinity tokens are broken JSON: fine here)."""
    try:
        if wire == "json":
            return json.dumps(document, default=repr).encode("utf-8", "surrogatepass")
        return msgspec.msgpack.encode(document)
    except (OverflowError, TypeError, ValueError, RecursionError):
        return b"\xc1"  # cannot be encoded: send a reserved msgpack byte instead


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid msgpack ready response, then truncated, with bytes flipped, inserted, dropped or repeated."""
    data = bytearray(fixture_bytes(draw(st.sampled_from(case_names()))))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["truncate", "flip", "insert", "drop", "repeat"]))
        if action == "truncate":
            del data[at:]
        elif action == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif action == "drop":
            del data[at : at + draw(st.integers(1, 16))]
        else:
            data[at:at] = data[at : at + draw(st.integers(1, 64))]
    return bytes(data)


names = (
    st.sampled_from(DEPLOYMENTS)
    | st.text(alphabet=st.sampled_from("ab/_.:@+-\"{}\\\n\r %?#=,'é\x00"), min_size=0, max_size=30)
    | st.sampled_from(["engines", "a/engines/1", "../x", "a//b", "x" * 201, "-lead", ".hidden", "a/"])
)


def ready_path(name: str, engine: object = None) -> str:
    query = f"?engine={quote(str(engine), safe='')}" if engine is not None else ""
    return f"/api/v1/deployments/{quote(name, safe='/')}/ready{query}"


# The tests -----------------------------------------------------------------------------------------------


def test_random_bytes_in_any_content_type(checked: Checked, record_property: Callable[[str, object], None]) -> None:
    @settings(max_examples=2000, **SETTINGS)
    @given(
        body=st.binary(max_size=2048) | st.sampled_from([b"", b"{", b"[]", b"null", b"\x80", b"\xc0", b"\xde\xff\xff"]),
        content_type=st.sampled_from(READY_TYPES + OTHER_TYPES) | st.none(),
        name=st.sampled_from(DEPLOYMENTS),
    )
    def check(body: bytes, content_type: str | None, name: str) -> None:
        checked.send("POST", ready_path(name), body, content_type)

    run(checked, record_property, "random_bytes", check)


def test_mutated_msgpack_ready_responses(checked: Checked, record_property: Callable[[str, object], None]) -> None:
    @settings(max_examples=2500, **SETTINGS)
    @given(body=mutated(), name=st.sampled_from(DEPLOYMENTS), content_type=st.sampled_from(READY_TYPES[:3]))
    def check(body: bytes, name: str, content_type: str) -> None:
        checked.send("POST", ready_path(name), body, content_type)

    run(checked, record_property, "mutated_msgpack", check)


def test_wrong_types_huge_values_and_nesting(checked: Checked, record_property: Callable[[str, object], None]) -> None:
    @settings(max_examples=2500, **SETTINGS)
    @given(document=ready_documents(), wire=st.sampled_from(["msgpack", "json"]), name=st.sampled_from(DEPLOYMENTS))
    def check(document: dict[str, Any], wire: str, name: str) -> None:
        content_type = "application/json" if wire == "json" else "application/vnd.msgpack"
        checked.send("POST", ready_path(name), encode(document, wire), content_type)

    run(checked, record_property, "wrong_types", check)


def test_engine_indexes_inside_and_outside_data_parallel_size(
    checked: Checked, record_property: Callable[[str, object], None]
) -> None:
    @settings(max_examples=1000, **SETTINGS)
    @given(
        size=st.integers(-1, 6) | st.sampled_from([2**16, 2**16 + 1, 2**40]),
        rank=st.integers(-2, 8) | st.none(),
        engine=st.none() | st.integers(-3, 9) | st.sampled_from(["x", "1.5", "1e3", "", str(2**70), "0x1"]),
        name=st.sampled_from(DEPLOYMENTS),
    )
    def check(size: int, rank: int | None, engine: object, name: str) -> None:
        document = dict(FIXTURES[0], data_parallel_size=size, dp_stats_address=None, instance_id="fixed")
        if rank is None:
            del document["data_parallel_rank"]
        else:
            document["data_parallel_rank"] = rank
        checked.send("POST", ready_path(name, engine), encode(document, "msgpack"), "application/vnd.msgpack")

    run(checked, record_property, "engine_indexes", check)


def test_hostile_deployment_names_on_every_route(
    checked: Checked, record_property: Callable[[str, object], None]
) -> None:
    @settings(max_examples=1000, **SETTINGS)
    @given(name=names, route=st.sampled_from(["ready", "config", "delete", "delete-engine"]), engine=st.integers(0, 3))
    def check(name: str, route: str, engine: int) -> None:
        path = f"/api/v1/deployments/{quote(name, safe='/')}"
        if route == "ready":
            checked.send("POST", ready_path(name), fixture_bytes("dense-post50809"), "application/vnd.msgpack")
        elif route == "config":
            checked.send("PUT", f"{path}/cache-config", b'{"mamba_cache_mode": "align"}', "application/json")
        elif route == "delete":
            checked.send("DELETE", path)
        else:
            checked.send("DELETE", f"{path}/engines/{engine}")

    run(checked, record_property, "deployment_names", check)


LABEL_NAMES = sorted({label.name for release in releases() for label in release.cache_config.labels})


@st.composite
def cache_configs(draw: st.DrawFn) -> bytes:
    """Static cache configs: valid fields with hostile values, unknown fields, broken JSON."""
    document = {
        draw(st.sampled_from([*LABEL_NAMES, "blok-size", "", "__proto__", "engine"])): draw(
            nested | st.integers(0, 4096) | st.sampled_from([True, 0.5, "auto", "align", None, []])
        )
        for _ in range(draw(st.integers(0, 4)))
    }
    body = encode(document, "json")
    if draw(st.integers(0, 9)) == 0:
        body = body[: draw(st.integers(0, len(body)))]
    return body


def test_static_cache_configs_cannot_break_or_forge_series(
    checked: Checked, record_property: Callable[[str, object], None]
) -> None:
    assert checked.send("POST", ready_path("qwen"), fixture_bytes("dp2-rank0"), "application/vnd.msgpack") == 200

    @settings(max_examples=1500, **SETTINGS)
    @given(body=cache_configs(), name=st.sampled_from(DEPLOYMENTS), content_type=st.sampled_from(["application/json",
           "application/vnd.msgpack", "text/plain"]))  # fmt: skip
    def check(body: bytes, name: str, content_type: str) -> None:
        checked.send("PUT", f"/api/v1/deployments/{quote(name, safe='/')}/cache-config", body, content_type)

    run(checked, record_property, "cache_configs", check)


def test_forging_attempts_in_label_values_are_escaped(checked: Checked) -> None:
    """Strings that would end a label value and start another series are shown as the value they are."""
    forged = 'auto"} cache_config_info{deployment="evil",engine="9"} 1\n# EOF\ncache_dtype="'
    for value in (forged, "a\\", "\\n", "x\ny", '"', "}", "\u2028"):
        body = json.dumps({"cache_dtype": value[:256], "kv_offloading_backend": value[:256]}).encode()
        assert checked.send("PUT", "/api/v1/deployments/qwen/cache-config", body, "application/json") == 200
        assert checked.send("POST", ready_path("qwen"), fixture_bytes("dp2-rank0"), "application/vnd.msgpack") == 200
    series = cache_config_samples(checked.client.get("/metrics").text)
    assert {dict(labels)["deployment"] for _, labels, _ in series} == {"qwen"}


def nesting(depth: int, wire: str) -> bytes:
    return b"\x91" * depth + b"\x00" if wire == "msgpack" else b"[" * depth + b"0" + b"]" * depth


@pytest.mark.parametrize("wire", ["msgpack", "json"])
@pytest.mark.parametrize("where", ["zzz_unknown_key", "kv_events_config", "(whole body)"])
def test_deep_nesting_is_refused_with_a_4xx(checked: Checked, wire: str, where: str) -> None:
    """Thousands of nested arrays (a few KiB) hit the decoder's depth guard: a 4xx, not a crash or a 500."""
    value = nesting(20_000, wire)
    if where == "(whole body)":
        body = value
    elif wire == "msgpack":
        key = where.encode()
        body = b"\x83\xadmax_model_len\x01\xaenum_gpu_blocks\x01" + bytes([0xA0 | len(key)]) + key + value
    else:
        body = b'{"max_model_len": 1, "num_gpu_blocks": 1, "%s": %s}' % (where.encode(), value)
    content_type = "application/json" if wire == "json" else "application/vnd.msgpack"
    assert checked.send("POST", ready_path("qwen"), body, content_type) in (400, 422)
    config = b'{"kv_cache_dtype_skip_layers": %s}' % nesting(20_000, "json")
    assert checked.send("PUT", "/api/v1/deployments/qwen/cache-config", config, "application/json") in (400, 422)
