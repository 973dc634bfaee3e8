"""The vLLM plugin's delivery rules, step by step with a made-up clock: no threads, no sockets, no waiting.

``now`` is seconds on the outbox's monotonic clock; each answer is what ``exporter.vllm_plugin.sender`` would return.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from exporter.vllm_plugin import sender
from exporter.vllm_plugin.outbox import MAX_BATCH_BYTES, Attempt, Backoff, Outbox, Update, Verdict, verdict_of

HEARTBEAT = 10.0
FIRST_RETRY = 0.5
MAX_RETRY = 4.0
LABELS = {"block_size": "16", "num_gpu_blocks": "1997"}
ACCEPTED = sender.Accepted(None)
AWAY = sender.Unreachable("[Errno 111] Connection refused")
NOT_HELD = sender.Rejected(404, "replica 'r1' of 'org/m' is not held", "replica")
FIELD_REFUSED = sender.Rejected(422, "'None' is not an integer", "prefix_cache_retention_interval")


WINDOW = 1.0


def outbox(heartbeat: float = HEARTBEAT, window: float = 0.0) -> Outbox:
    """Without a window unless asked: what is offered before a request is due goes in it."""
    return Outbox(heartbeat, Backoff(FIRST_RETRY, MAX_RETRY, heartbeat), window)


def update(
    engine: int = 0, run: str | None = "run-1", replica: str = "r1", labels: dict[str, str] = LABELS, size: int = 0
) -> Update:
    """A ready response of ``engine`` in ``run``; its payload (msgpack) names both, so that the tests can tell it
    apart, padded to ``size`` bytes."""
    name = f"{run}/{engine}"
    payload = msgspec.msgpack.encode(name.ljust(size - 3) if size else name)
    return Update("org/m", replica, dict(labels), engine, run, payload)


def due(box: Outbox, now: float) -> Attempt:
    """The request due at ``now`` (fails when the outbox waits instead)."""
    attempt = box.due(now)
    assert isinstance(attempt, Attempt), f"nothing due at {now}, but in {attempt} s"
    return attempt


def described(attempt: Attempt) -> str:
    """What ``attempt`` sends: ``labels``, the ready responses' payloads (``run/engine``, several in one request
    joined by ``+``), or ``heartbeat r1``."""
    if attempt.kind == "config":
        return "labels"
    if attempt.kind == "engines":
        assert attempt.call.body is not None
        sent = msgspec.msgpack.decode(attempt.call.body)
        return "+".join(name.strip() for name in sent) if isinstance(sent, list) else sent.strip()
    return f"heartbeat {attempt.replica}"


def deliver(box: Outbox, now: float) -> list[str]:
    """Let the exporter take whatever is due at ``now`` until only heartbeats are left; what was sent."""
    sent = []
    while isinstance(attempt := box.due(now), Attempt) and attempt.kind != "heartbeat":
        sent.append(described(attempt))
        assert box.record(attempt, ACCEPTED, now) is Verdict.DELIVERED
    return sent


def failing_waits(box: Outbox, now: float, failures: int) -> list[float]:
    """The waits after ``failures`` failed attempts in a row, each made as soon as it is due."""
    waits = []
    for _ in range(failures):
        assert box.record(due(box, now), AWAY, now) is Verdict.RETRY
        wait = box.due(now)
        assert isinstance(wait, float)
        waits.append(wait)
        now += wait
    return waits


def test_labels_go_before_the_ready_responses_and_heartbeats_only_once_everything_is_delivered() -> None:
    box = outbox()
    box.offer(update(0), 0)
    labels = due(box, 0)
    assert (labels.call.method, labels.call.path) == (
        "PUT",
        "/api/v1/deployments/org/m/cache-config?replica=r1&heartbeat=10",
    )
    assert json.loads(labels.call.body or b"") == LABELS
    box.record(labels, ACCEPTED, 0)
    engine = due(box, 0)
    assert (engine.call.method, engine.call.path) == ("POST", "/api/v1/deployments/org/m/ready?replica=r1&heartbeat=10")
    box.record(engine, ACCEPTED, 0)
    box.offer(update(1), 1)
    # A heartbeat would be due by now, but engine 1's ready response is not delivered yet: it goes first.
    assert described(due(box, HEARTBEAT + 1)) == "run-1/1"
    assert deliver(box, HEARTBEAT + 1) == ["run-1/1"]
    assert box.due(HEARTBEAT + 1) == HEARTBEAT
    heartbeat = due(box, 2 * HEARTBEAT + 1)
    assert (heartbeat.call.method, heartbeat.call.path) == (
        "POST",
        "/api/v1/deployments/org/m/heartbeat?replica=r1&interval=10",
    )


def test_the_earliest_heartbeat_goes_first() -> None:
    box = outbox()
    box.offer(update(replica="r1"), 0)
    box.offer(update(replica="r2"), 0)
    box.record(due(box, 0), ACCEPTED, 0)
    box.record(due(box, 0), ACCEPTED, 0)
    # r2's labels and response are taken 3 s after r1's.
    assert deliver(box, 3) == ["labels", "run-1/0"]
    assert box.due(HEARTBEAT - 1) == 1
    first = due(box, HEARTBEAT)
    assert described(first) == "heartbeat r1"
    box.record(first, ACCEPTED, HEARTBEAT)
    assert box.due(HEARTBEAT) == 3
    assert described(due(box, HEARTBEAT + 3)) == "heartbeat r2"


def test_backoff_doubles_from_the_first_wait_up_to_the_cap() -> None:
    backoff = Backoff(0.5, 30.0, 86400.0)
    assert [backoff.failed() for _ in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


@pytest.mark.parametrize(("heartbeat", "waits"), [(5.0, [0.5, 1, 2, 4, 5, 5]), (1.0, [0.5, 1, 1, 1])])
def test_backoff_never_waits_beyond_one_heartbeat_interval(heartbeat: float, waits: list[float]) -> None:
    """So that an exporter that is back has the whole state within one interval."""
    backoff = Backoff(0.5, 30.0, heartbeat)
    assert [backoff.failed() for _ in waits] == waits


def test_backoff_starts_again_from_the_first_wait_once_reset() -> None:
    backoff = Backoff(0.5, 30.0, 30.0)
    for _ in range(4):
        backoff.failed()
    backoff.reset()
    assert [backoff.failed() for _ in range(3)] == [0.5, 1, 2]


def test_while_the_exporter_is_away_every_request_waits_out_a_doubling_backoff_capped_by_the_heartbeat() -> None:
    box = outbox(heartbeat=2.0)
    box.offer(update(), 0)
    assert failing_waits(box, 0, 5) == [0.5, 1, 2, 2, 2]
    # Only the labels were tried, and they are still owed, with the ready response.
    assert box.backlog() == 2


@pytest.mark.parametrize("answer", [ACCEPTED, NOT_HELD], ids=["delivered", "not-held"])
def test_an_answer_backs_off_from_scratch_at_the_next_outage(answer: sender.CallResult) -> None:
    box = outbox()
    box.offer(update(), 0)
    deliver(box, 0)
    assert failing_waits(box, HEARTBEAT, 3) == [0.5, 1, 2]
    now = HEARTBEAT + 3.5
    box.record(due(box, now), answer, now)
    box.offer(update(1), 0)
    assert failing_waits(box, now, 2) == [0.5, 1]


def test_after_an_outage_the_first_answer_checks_at_once_that_the_exporter_still_holds_the_replica() -> None:
    box = outbox()
    box.offer(update(0), 0)
    deliver(box, 0)
    box.offer(update(1), 0)
    assert failing_waits(box, 1, 1) == [FIRST_RETRY]
    assert deliver(box, 1.5) == ["run-1/1"]
    # Not one heartbeat interval later: the exporter may have lost the replica while it was away.
    assert described(due(box, 1.5)) == "heartbeat r1"


def test_a_heartbeat_the_exporter_does_not_know_sends_everything_again() -> None:
    box = outbox()
    box.offer(update(0), 0)
    box.offer(update(1), 0)
    deliver(box, 0)
    assert box.goodbyes() == [sender.goodbye_call("org/m", "r1")]
    assert box.record(due(box, HEARTBEAT), NOT_HELD, HEARTBEAT) is Verdict.NOT_HELD
    # A new or restarted exporter: it holds nothing to say goodbye to, and gets the whole state again.
    assert box.goodbyes() == []
    assert box.backlog() == 3
    assert deliver(box, HEARTBEAT) == ["labels", "run-1/0+run-1/1"]
    assert box.goodbyes() == [sender.goodbye_call("org/m", "r1")]


def test_a_refused_cache_config_leaves_the_replica_held() -> None:
    box = outbox()
    box.offer(update(), 0)
    deliver(box, 0)
    # The engine answers again, and vLLM's labels now hold a value the exporter refuses.
    box.offer(update(labels={**LABELS, "prefix_cache_retention_interval": "None"}), 0)
    assert box.record(due(box, 1), FIELD_REFUSED, 1) is Verdict.LABELS_REFUSED
    # The exporter still holds the replica: were vLLM to shut down now, the goodbye must go.
    assert box.goodbyes() == [sender.goodbye_call("org/m", "r1")]
    # Refused for good, so not tried again; the ready response goes, and a final refusal of it holds on too.
    assert box.backlog() == 1
    assert box.record(due(box, 1), sender.Rejected(409, "contradicts", "dp_stats_address"), 1) is Verdict.REFUSED
    assert box.backlog() == 0
    assert box.goodbyes() == [sender.goodbye_call("org/m", "r1")]
    assert box.due(1) == HEARTBEAT
    assert described(due(box, 1 + HEARTBEAT)) == "heartbeat r1"


def test_refused_labels_of_a_new_replica_hold_nothing_until_a_ready_response_is_taken() -> None:
    box = outbox()
    box.offer(update(), 0)
    assert box.record(due(box, 0), FIELD_REFUSED, 0) is Verdict.LABELS_REFUSED
    assert box.goodbyes() == []
    assert deliver(box, 0) == ["run-1/0"]
    assert box.goodbyes() == [sender.goodbye_call("org/m", "r1")]


@pytest.mark.parametrize("delivered_first", [True, False], ids=["delivered", "exporter-away"])
def test_a_new_run_never_sends_an_engine_of_the_previous_run_again(delivered_first: bool) -> None:
    box = outbox()
    box.offer(update(0, "run-1"), 0)
    box.offer(update(1, "run-1"), 0)
    if delivered_first:
        deliver(box, 0)
    # The server restarted; engine 1 of the new run has not answered yet.
    box.offer(update(0, "run-2"), 0)
    assert box.backlog() == (1 if delivered_first else 2)
    assert deliver(box, 0) == (["run-2/0"] if delivered_first else ["labels", "run-2/0"])
    # Not even when a new exporter asks for everything again.
    box.record(due(box, HEARTBEAT), NOT_HELD, HEARTBEAT)
    assert deliver(box, HEARTBEAT) == ["labels", "run-2/0"]


def test_a_response_superseded_while_in_flight_goes_again_in_its_newest_version() -> None:
    box = outbox()
    box.offer(update(0, run=None), 0)
    deliver(box, 0)
    box.offer(update(0, run="run-1"), 0)
    in_flight = due(box, 1)
    box.offer(update(0, run="run-2"), 0)
    box.record(in_flight, ACCEPTED, 1)
    assert deliver(box, 1) == ["run-2/0"]


def test_backlog_counts_what_the_exporter_has_still_to_take_newest_only() -> None:
    box = outbox()
    assert box.backlog() == 0
    assert box.due(0) == float("inf")
    for _ in range(100):
        box.offer(update(0), 0)
        box.offer(update(1), 0)
    # The labels and one ready response per engine, however many times they were offered.
    assert box.backlog() == 3
    box.record(due(box, 0), ACCEPTED, 0)
    assert box.backlog() == 2
    box.offer(update(0, labels={**LABELS, "num_gpu_blocks": "3994"}), 0)
    assert box.backlog() == 3
    deliver(box, 0)
    assert box.backlog() == 0


@pytest.mark.parametrize(
    ("kind", "outcome", "verdict"),
    [
        ("engines", ACCEPTED, Verdict.DELIVERED),
        ("heartbeat", sender.Accepted(None), Verdict.DELIVERED),
        ("engines", AWAY, Verdict.RETRY),
        ("engines", sender.Rejected(503, "", None), Verdict.RETRY),
        # The token file may be rotated.
        ("config", sender.Rejected(401, "missing bearer token", None), Verdict.RETRY),
        ("heartbeat", NOT_HELD, Verdict.NOT_HELD),
        ("engines", sender.Rejected(404, "", None), Verdict.REFUSED),
        ("engines", sender.Rejected(409, "dp_stats_address differs", "dp_stats_address"), Verdict.REFUSED),
        ("config", FIELD_REFUSED, Verdict.LABELS_REFUSED),
        ("config", sender.Rejected(413, "too large", None), Verdict.REFUSED),
    ],
)
def test_what_an_answer_means(kind: str, outcome: sender.CallResult, verdict: Verdict) -> None:
    call = sender.Call("POST", "/")
    assert verdict_of(Attempt("org/m", "r1", kind, ((0, 1),), call), outcome) is verdict  # type: ignore[arg-type]


def test_a_final_refusal_is_not_tried_again_but_a_newer_version_is() -> None:
    box = outbox()
    box.offer(update(0), 0)
    deliver(box, 0)
    box.offer(update(0, run="run-2"), 0)
    assert box.record(due(box, 1), sender.Rejected(409, "contradicts", "dp_stats_address"), 1) is Verdict.REFUSED
    assert box.backlog() == 0
    box.offer(update(0, run="run-3"), 0)
    assert deliver(box, 1) == ["run-3/0"]


def test_what_the_engines_report_within_the_window_goes_in_one_request() -> None:
    box = outbox(window=WINDOW)
    # vLLM's frontend labels change with every engine's response (it sums their blocks): the newest go once.
    for engine in range(8):
        box.offer(update(engine, "run-1", labels={**LABELS, "num_gpu_blocks": str(engine)}), engine / 10)
        assert box.due(engine / 10) == pytest.approx(WINDOW - engine / 10)
    labels = due(box, WINDOW)
    assert json.loads(labels.call.body or b"")["num_gpu_blocks"] == "7"
    box.record(labels, ACCEPTED, WINDOW)
    batch = due(box, WINDOW)
    assert (batch.call.method, batch.call.path) == ("POST", "/api/v1/deployments/org/m/ready?replica=r1&heartbeat=10")
    assert described(batch) == "+".join(f"run-1/{engine}" for engine in range(8))
    assert box.record(batch, ACCEPTED, WINDOW) is Verdict.DELIVERED
    assert box.backlog() == 0
    # The engines restart: eight responses again, the labels changing meanwhile but ending as delivered.
    for engine in range(8):
        box.offer(update(engine, "run-2", labels={**LABELS, "num_gpu_blocks": str(engine)}), 5 + engine / 100)
    assert box.due(5.5) == pytest.approx(WINDOW - 0.5)
    assert deliver(box, 5 + WINDOW) == ["+".join(f"run-2/{engine}" for engine in range(8))]


def test_a_response_offered_after_the_window_goes_in_the_next_request() -> None:
    box = outbox(window=WINDOW)
    box.offer(update(0), 0)
    assert deliver(box, WINDOW) == ["labels", "run-1/0"]
    box.offer(update(1), WINDOW + 5)
    # A single response goes as it is, not as an array: exporters without arrays take it.
    assert due(box, 2 * WINDOW + 5).call.body == update(1).payload


def batch_answer(*refusals: tuple[int, int, str]) -> sender.Accepted:
    """The exporter's answer to an array of which it took some: each refusal as (index, status, field)."""
    refused = [{"index": index, "status": status, "detail": "no", "field": field} for index, status, field in refusals]
    return sender.Accepted({"replica": {}, "refused": refused})


def test_a_refused_response_of_a_request_goes_no_more_and_the_others_are_delivered() -> None:
    box = outbox()
    for engine in range(3):
        box.offer(update(engine), 0)
    box.record(due(box, 0), ACCEPTED, 0)
    batch = due(box, 0)
    assert box.record(batch, batch_answer((1, 409, "$[1].dp_stats_address")), 0) is Verdict.REFUSED
    assert box.backlog() == 0
    assert box.goodbyes() == [sender.goodbye_call("org/m", "r1")]
    assert described(due(box, HEARTBEAT)) == "heartbeat r1"


def test_a_response_refused_for_now_goes_again_after_the_backoff_alone() -> None:
    box = outbox()
    for engine in range(3):
        box.offer(update(engine), 0)
    box.record(due(box, 0), ACCEPTED, 0)
    assert box.record(due(box, 0), batch_answer((2, 429, "engine")), 0) is Verdict.RETRY
    assert box.due(0) == FIRST_RETRY
    assert deliver(box, FIRST_RETRY) == ["run-1/2"]


def test_a_request_none_of_which_is_taken_is_judged_response_by_response() -> None:
    box = outbox()
    box.offer(update(0), 0)
    box.offer(update(1), 0)
    box.record(due(box, 0), ACCEPTED, 0)
    items = {0: sender.Rejected(422, "no", "$[0].block_size"), 1: sender.Rejected(429, "full", "engine")}
    assert box.record(due(box, 0), sender.Rejected(422, "no", "$[0].block_size", items), 0) is Verdict.RETRY
    assert deliver(box, FIRST_RETRY) == ["run-1/1"]


@pytest.mark.parametrize(
    "refusal",
    [sender.Rejected(413, "the body is over 65536 bytes", None), sender.Rejected(422, "Expected `object`", "$")],
    ids=["over-the-body-limit", "exporter-without-arrays"],
)
def test_a_request_refused_whole_goes_again_one_response_a_request(refusal: sender.Rejected) -> None:
    box = outbox()
    box.offer(update(0), 0)
    box.offer(update(1), 0)
    box.record(due(box, 0), ACCEPTED, 0)
    assert box.record(due(box, 0), refusal, 0) is Verdict.SPLIT
    assert deliver(box, 0) == ["run-1/0", "run-1/1"]


def test_a_request_holds_no_more_responses_than_fit_the_body_limit() -> None:
    box = outbox()
    size = MAX_BATCH_BYTES // 3
    for engine in range(4):
        box.offer(update(engine, size=size), 0)
    assert deliver(box, 0) == ["labels", "run-1/0+run-1/1+run-1/2", "run-1/3"]


def test_a_batch_taken_with_an_answer_too_long_to_read_goes_again_one_response_a_request() -> None:
    """The exporter's answer names the refused responses after the replica's whole state: of a replica of many
    engines it is longer than the plugin reads, so the responses go again one a request, whose answers say."""
    box = outbox()
    box.offer(update(0), 0)
    box.offer(update(1), 0)
    box.record(due(box, 0), ACCEPTED, 0)
    assert box.record(due(box, 0), sender.Accepted(None, unread=True), 0) is Verdict.SPLIT
    assert box.backlog() == 2
    assert deliver(box, 0) == ["run-1/0", "run-1/1"]
    # One response alone, taken with an unread answer: taken (a refusal would have been a 4xx).
    box.offer(update(0, "run-2"), 1)
    attempt = due(box, 1)
    assert box.record(attempt, sender.Accepted(None, unread=True), 1) is Verdict.DELIVERED
    assert box.backlog() == 0


def shed(seconds: float, status: int = 429) -> sender.Rejected:
    """An answer asking to wait ``seconds`` (``Retry-After``, as ``retry_after.seconds_of`` made it)."""
    return sender.Rejected(status, "Limit reached", None, retry_after=seconds)


def test_retry_after_holds_every_request_for_as_long_as_it_asks_beyond_the_backoff() -> None:
    box = outbox()
    box.offer(update(0), 0)
    assert box.record(due(box, 0), shed(120.0), 0) is Verdict.RETRY
    # The backoff alone would wait FIRST_RETRY, and never more than MAX_RETRY.
    assert box.due(0) == 120.0
    assert box.due(119.9) == pytest.approx(0.1)
    # A newer ready response meanwhile waits too, and goes, with its labels, as soon as the wait ends.
    box.offer(update(0, "run-2"), 60)
    assert box.due(60) == 60.0
    assert deliver(box, 120) == ["labels", "run-2/0"]


def test_retry_after_shorter_than_the_backoff_waits_the_backoff() -> None:
    box = outbox()
    box.offer(update(0), 0)
    assert box.record(due(box, 0), shed(0.0, 503), 0) is Verdict.RETRY
    assert box.due(0) == FIRST_RETRY


def test_heartbeats_resume_after_the_wait_retry_after_asks_for() -> None:
    box = outbox()
    box.offer(update(0), 0)
    deliver(box, 0)
    heartbeat = due(box, HEARTBEAT)
    assert box.record(heartbeat, shed(300.0, 503), HEARTBEAT) is Verdict.RETRY
    assert box.due(HEARTBEAT + 299) == pytest.approx(1.0)
    assert described(due(box, HEARTBEAT + 300)) == "heartbeat r1"
    assert box.record(due(box, HEARTBEAT + 300), sender.Accepted(None), HEARTBEAT + 300) is Verdict.DELIVERED
