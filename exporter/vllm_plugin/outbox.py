"""What one vLLM server's plugin owes one exporter, as a value: which request is due when, and what an answer means.

The plugin's delivery thread (``delivery``) holds the thread, the lock and the clock; the
rules live here, without either, so that they can be driven step by step with a made-up ``now``
(monotonic seconds):

- per replica, only what the exporter must end up holding: the newest static labels and the newest ready
  response of each engine of the current run (a new ``instance_id`` drops the previous run's), each with a
  version; an item is delivered when the exporter took its current version, so memory stays bounded by
  the number of engines however long the exporter is away;
- labels go before the ready responses they belong with; heartbeats only once everything is delivered,
  the earliest first;
- what a replica's engines report within ``window`` seconds of the first goes together: the newest labels
  (unless they are back to those delivered), then the ready responses as one request (one commit: a DP=8
  server's restart is one request), each still taken or refused alone; an exporter that refuses such a
  request whole (over its body limit, or one without arrays), or takes it with an answer too long to read which
  ones it refused, gets one ready response a request;
- while the exporter is away every request waits out a ``Backoff``, or the longer wait its ``Retry-After`` asks
  for (up to ``retry_after.MAX_WAIT_SECONDS``), heartbeats included; what is due then goes at once;
- a heartbeat the exporter does not know (404) means it lost the replica: everything goes again.

Imports only the standard library and ``exporter.vllm_plugin.sender``: it runs inside vLLM's frontend.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from exporter.vllm_plugin import sender

# Answers that may change on their own (401 and 403 too: the token file may be rotated);
# any other refusal (400, 409, 422, ...) is final for what was sent.
RETRY_STATUSES = frozenset({401, 403, 408, 425, 429, 500, 502, 503, 504})
# The ready responses of one request: well below the exporter's default body limit (64 KiB).
MAX_BATCH_BYTES = 48 * 1024


class Backoff:
    """The waits while an exporter is away: doubling from the first wait up to the cap, never beyond one
    heartbeat interval, so that an exporter that is back has the whole state within one interval."""

    def __init__(self, first_seconds: float, max_seconds: float, heartbeat_seconds: float) -> None:
        self._first = first_seconds
        self._ceiling = min(max_seconds, heartbeat_seconds)
        self._next = first_seconds

    def failed(self) -> float:
        """An attempt failed: the seconds to wait before the next one (and the one after waits twice as long)."""
        wait = min(self._next, self._ceiling)
        self._next = 2 * wait
        return wait

    def reset(self) -> None:
        """The exporter answered: the next outage backs off from the first wait again."""
        self._next = self._first


class Update(NamedTuple):
    """One ready response as the frontend applied it, with the frontend's labels at that moment."""

    deployment: str
    replica: str
    config: dict[str, str]
    engine: int
    run: str | None
    payload: bytes


@dataclass
class _Replica:
    """What the exporter must end up holding of one replica: its newest labels, the newest response per engine.

    Every item carries a version; it is delivered when its version is the one last accepted.
    """

    deployment: str
    name: str
    config: dict[str, str] | None = None
    config_version: int = 0
    config_delivered: int = 0
    # The labels at ``config_delivered`` (``None`` when not known): labels that change and come back are not sent.
    delivered_config: dict[str, str] | None = None
    run: str | None = None
    engines: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    engines_delivered: dict[int, int] = field(default_factory=dict)
    # The exporter took part of this state: heartbeats keep it there, and the goodbye removes it.
    held: bool = False
    next_heartbeat: float = math.inf
    # Ready responses offered until then go with the first undelivered one.
    gathering_until: float = -math.inf

    def pending(self) -> list[tuple[int, int, bytes]]:
        """The ready responses the exporter has still to take: (engine, version, payload), by engine."""
        return sorted(
            (index, version, payload)
            for index, (version, payload) in self.engines.items()
            if self.engines_delivered.get(index) != version
        )

    def undelivered(self) -> int:
        return int(self.config_version != self.config_delivered) + len(self.pending())

    def forget_delivery(self) -> None:
        """The exporter does not hold this replica: everything goes again."""
        self.config_delivered = 0
        self.delivered_config = None
        self.engines_delivered.clear()
        self.held = False
        self.next_heartbeat = math.inf


class Attempt(NamedTuple):
    """One request due: the ``kind`` of items of a replica, at the ``versions`` delivered once taken: the labels'
    as ``(0, version)``, each ready response's as ``(engine, version)`` in the order sent; none for a heartbeat."""

    deployment: str
    replica: str
    kind: Literal["config", "engines", "heartbeat"]
    versions: tuple[tuple[int, int], ...]
    call: sender.Call


class Verdict(enum.Enum):
    """What an answer means for what was sent."""

    # The exporter took it.
    DELIVERED = enum.auto()
    # No answer, or one that may change on its own: every request waits out the backoff.
    RETRY = enum.auto()
    # Rejected for good: only a newer version goes again.
    REFUSED = enum.auto()
    # The labels refused for good because of one field: the ready responses still go.
    LABELS_REFUSED = enum.auto()
    # A heartbeat the exporter does not know (new, restarted, or its storage lost): everything goes again.
    NOT_HELD = enum.auto()
    # Several ready responses refused whole, none named: they go again one a request.
    SPLIT = enum.auto()


def verdict_of(attempt: Attempt, outcome: sender.CallResult) -> Verdict:
    """What ``outcome`` means for ``attempt``."""
    if isinstance(outcome, sender.Accepted):
        return Verdict.DELIVERED
    if isinstance(outcome, sender.Unreachable) or outcome.status in RETRY_STATUSES:
        return Verdict.RETRY
    if attempt.kind == "heartbeat" and outcome.status == 404:
        return Verdict.NOT_HELD
    if attempt.kind == "config" and outcome.field and 400 <= outcome.status < 500:
        return Verdict.LABELS_REFUSED
    return Verdict.REFUSED


def outcomes_of(attempt: Attempt, outcome: sender.CallResult) -> list[sender.CallResult]:
    """What came of each item of ``attempt``: the exporter's refusal of it, else the answer to the whole request."""
    if isinstance(outcome, sender.Accepted) and isinstance(outcome.state, dict):
        refused = sender.item_refusals(outcome.state.get("refused"))
    elif isinstance(outcome, sender.Rejected):
        refused = outcome.items
    else:
        refused = {}
    return [refused.get(place, outcome) for place in range(len(attempt.versions) or 1)]


def _split(attempt: Attempt, outcome: sender.CallResult) -> bool:
    """Several ready responses refused for good as a whole, none of them named, or taken with an answer left unread
    (``sender.ANSWER_BYTES``), which would name those refused: they go one a request."""
    if attempt.kind != "engines" or len(attempt.versions) < 2:
        return False
    if isinstance(outcome, sender.Accepted):
        return outcome.unread
    return isinstance(outcome, sender.Rejected) and not outcome.items and outcome.status not in RETRY_STATUSES


class Outbox:
    """What one exporter is owed, and which request is due when; ``now`` is always the caller's."""

    def __init__(self, heartbeat_seconds: float, backoff: Backoff, window_seconds: float) -> None:
        self._heartbeat_seconds = heartbeat_seconds
        self._backoff = backoff
        self._window = window_seconds
        self._batch_bytes = MAX_BATCH_BYTES
        self._replicas: dict[tuple[str, str], _Replica] = {}
        self._versions = itertools.count(1)
        self._retry_at = -math.inf
        # Nothing answered since a failure: the log warns once per outage, and the end of one checks the replicas.
        self.failing = False

    def offer(self, update: Update, now: float) -> None:
        """Take ``update``, offered at ``now``, as the newest state of its engine (and labels)."""
        key = (update.deployment, update.replica)
        replica = self._replicas.setdefault(key, _Replica(update.deployment, update.replica))
        if not replica.undelivered():
            replica.gathering_until = now + self._window
        if update.config != replica.config:
            replica.config = update.config
            replica.config_version = next(self._versions)
            if update.config == replica.delivered_config:
                replica.config_delivered = replica.config_version
        if update.run is not None and update.run != replica.run:
            # A new run of this server: the exporter drops the previous run's engines, and so does this.
            replica.run = update.run
            replica.engines.clear()
            replica.engines_delivered.clear()
        replica.engines[update.engine] = (next(self._versions), update.payload)

    def backlog(self) -> int:
        """How many items (labels, ready responses) the exporter has still to take."""
        return sum(replica.undelivered() for replica in self._replicas.values())

    def due(self, now: float) -> Attempt | float:
        """The request due at ``now``, else the seconds until one is (``inf``: until something is offered)."""
        if now < self._retry_at:
            return self._retry_at - now
        interval = self._heartbeat_seconds
        gathering = math.inf
        for replica in self._replicas.values():
            deployment, name = replica.deployment, replica.name
            if now < replica.gathering_until and replica.undelivered():
                gathering = min(gathering, replica.gathering_until - now)
            elif replica.config_version != replica.config_delivered:
                call = sender.cache_config_call(deployment, replica.config or {}, name, heartbeat=interval)
                return Attempt(deployment, name, "config", ((0, replica.config_version),), call)
            elif pending := replica.pending():
                return self._engines(replica, pending)
        if gathering < math.inf:
            return gathering
        replica = min(self._replicas.values(), key=lambda replica: replica.next_heartbeat, default=None)
        if replica is None or replica.next_heartbeat > now:
            return math.inf if replica is None else replica.next_heartbeat - now
        call = sender.heartbeat_call(replica.deployment, replica.name, interval)
        return Attempt(replica.deployment, replica.name, "heartbeat", (), call)

    def _engines(self, replica: _Replica, pending: list[tuple[int, int, bytes]]) -> Attempt:
        """The pending ready responses that fit one request: one alone goes as it is, several as an array."""
        sent, size = pending[:1], len(pending[0][2])
        for item in pending[1:]:
            size += len(item[2])
            if size > self._batch_bytes:
                break
            sent.append(item)
        interval = self._heartbeat_seconds
        payloads = [payload for _, _, payload in sent]
        if len(sent) == 1:
            call = sender.ready_call(replica.deployment, payloads[0], "msgpack", replica.name, heartbeat=interval)
        else:
            call = sender.ready_batch_call(replica.deployment, payloads, replica.name, heartbeat=interval)
        versions = tuple((index, version) for index, version, _ in sent)
        return Attempt(replica.deployment, replica.name, "engines", versions, call)

    def record(self, attempt: Attempt, outcome: sender.CallResult, now: float) -> Verdict:
        """Take what came of ``attempt``, answered at ``now``; the verdict (the worst of its items') is for the
        caller's log."""
        replica = self._replicas[(attempt.deployment, attempt.replica)]
        if _split(attempt, outcome):
            self._batch_bytes = 0
            return Verdict.SPLIT
        verdicts = [verdict_of(attempt, item) for item in outcomes_of(attempt, outcome)]
        if Verdict.NOT_HELD in verdicts:
            replica.forget_delivery()
            self._answered(now)
            return Verdict.NOT_HELD
        if any(verdict is not Verdict.RETRY for verdict in verdicts):
            taken = [
                item for item, verdict in zip(attempt.versions, verdicts, strict=False) if verdict is not Verdict.RETRY
            ]
            self._done(replica, attempt.kind, taken, Verdict.DELIVERED in verdicts, now)
        if Verdict.DELIVERED in verdicts:
            self._answered(now)
        if Verdict.RETRY in verdicts:
            asked = outcome.retry_after if isinstance(outcome, sender.Rejected) else None
            self._retry_at = now + max(self._backoff.failed(), asked or 0.0)
        # Logged as a failure is: the next answer ends it.
        self.failing = self.failing or Verdict.RETRY in verdicts or Verdict.REFUSED in verdicts
        return next((worst for worst in (Verdict.RETRY, Verdict.REFUSED) if worst in verdicts), verdicts[0])

    def goodbyes(self) -> list[sender.Call]:
        """A goodbye for each replica the exporter holds (vLLM shuts down cleanly)."""
        return [
            sender.goodbye_call(replica.deployment, replica.name) for replica in self._replicas.values() if replica.held
        ]

    def _done(self, replica: _Replica, kind: str, versions: list[tuple[int, int]], accepted: bool, now: float) -> None:
        """The items at ``versions`` are delivered (or refused for good): only a newer version goes again."""
        for index, version in versions:
            if kind == "config":
                replica.config_delivered = version
                replica.delivered_config = replica.config if version == replica.config_version else None
            elif kind == "engines" and index in replica.engines:
                replica.engines_delivered[index] = version
        # A refusal takes nothing from what the exporter holds already.
        replica.held = replica.held or accepted
        if replica.held:
            replica.next_heartbeat = now + self._heartbeat_seconds

    def _answered(self, now: float) -> None:
        """The exporter answered: back off from scratch; after an outage, check at once that it still holds us."""
        self._backoff.reset()
        if self.failing:
            self.failing = False
            for replica in self._replicas.values():
                if replica.held:
                    replica.next_heartbeat = min(replica.next_heartbeat, now)
