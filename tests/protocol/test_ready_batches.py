"""Several engines' ready responses in one request, as the plugin's sender makes it and a real exporter answers it.

The contract between ``vllm_plugin/sender.py`` (which writes the array and reads each refusal of the answer) and the
exporter's ``POST .../ready`` (which checks each response alone and commits the accepted ones together).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from exporter.vllm_plugin import sender
from tests.support import ExporterProcess, fixture_bytes

DEPLOYMENT = "org/dp2"


def send(exporter: ExporterProcess, *names: str, payloads: tuple[bytes, ...] = ()) -> sender.CallResult:
    call = sender.ready_batch_call(DEPLOYMENT, [*map(fixture_bytes, names), *payloads], "r1", heartbeat=30)
    return sender.send(exporter.url, call, 10, client="push")


def test_the_sender_array_is_taken_whole_and_its_refusals_are_read_one_by_one(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    exporter = start_exporter()
    taken = send(exporter, "dp2-rank0", "dp2-rank1")
    assert isinstance(taken, sender.Accepted)
    assert [engine["engine"] for engine in taken.state["replica"]["engines"]] == [0, 1]
    assert taken.state["replica"]["heartbeat_seconds"] == 30

    partly = send(exporter, "dp2-rank0", "dp2-rank1-conflicting-stats-address")
    assert isinstance(partly, sender.Accepted)
    assert [(place, refusal.status, refusal.field) for place, refusal in sender.item_refusals(
        partly.state["refused"]).items()] == [(1, 409, "$[1].dp_stats_address")]  # fmt: skip

    broken = msgspec.msgpack.encode({"max_model_len": 8})
    none = send(exporter, "dp2-rank1-conflicting-stats-address", payloads=(broken,))
    assert isinstance(none, sender.Rejected)
    assert (none.status, none.field) == (409, "$[0].dp_stats_address")
    assert {place: (refusal.status, refusal.field) for place, refusal in none.items.items()} == {
        0: (409, "$[0].dp_stats_address"),
        1: (422, "$[1].num_gpu_blocks"),
    }
