"""What one vLLM server's plugin owes one exporter, as a value: which request is due when, and what an answer means.

The plugin's delivery thread (``exporter/vllm_plugin.py``) holds the thread, the lock and the clock; the
rules live here, without either, so that they can be driven step by step with a made-up ``now``
(monotonic seconds):

- per replica, only what the exporter must end up holding: the newest static labels and the newest ready
  response of each engine of the current run (a new ``instance_id`` drops the previous run's), each with a
  version; an item is delivered when the exporter took its current version, so memory stays bounded by
  the number of engines however long the exporter is away;
- labels go before the ready responses they belong with; heartbeats only once everything is delivered,
  the earliest first;
- while the exporter is away every request waits out a ``Backoff``;
- a heartbeat the exporter does not know (404) means it lost the replica: everything goes again.

Imports only the standard library and ``exporter.sender``: it runs inside vLLM's frontend.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from exporter import sender

# Answers that may change on their own (401 and 403 too: the token file may be rotated);
# any other refusal (400, 409, 422, ...) is final for what was sent.
RETRY_STATUSES = frozenset({401, 403, 408, 425, 429, 500, 502, 503, 504})


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
    run: str | None = None
    engines: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    engines_delivered: dict[int, int] = field(default_factory=dict)
    # The exporter took part of this state: heartbeats keep it there, and the goodbye removes it.
    held: bool = False
    next_heartbeat: float = math.inf

    def undelivered(self) -> int:
        config = int(self.config_version != self.config_delivered)
        return config + sum(
            self.engines_delivered.get(index) != version for index, (version, _) in self.engines.items()
        )

    def forget_delivery(self) -> None:
        """The exporter does not hold this replica: everything goes again."""
        self.config_delivered = 0
        self.engines_delivered.clear()
        self.held = False
        self.next_heartbeat = math.inf


class Attempt(NamedTuple):
    """One request due: the ``kind`` of item of a replica, at the ``version`` that is delivered once it is taken."""

    deployment: str
    replica: str
    kind: Literal["config", "engine", "heartbeat"]
    engine: int
    version: int
    call: sender.Call


class Verdict(enum.Enum):
    """What an answer means for what was sent."""

    # The exporter took it.
    DELIVERED = enum.auto()
    # No answer, or one that may change on its own: every request waits out the backoff.
    RETRY = enum.auto()
    # Refused for good: only a newer version goes again.
    REFUSED = enum.auto()
    # The labels refused for good because of one field: the ready responses still go.
    LABELS_REFUSED = enum.auto()
    # A heartbeat the exporter does not know (new, restarted, or its storage lost): everything goes again.
    NOT_HELD = enum.auto()


def verdict_of(attempt: Attempt, outcome: sender.Outcome) -> Verdict:
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


class Outbox:
    """What one exporter is owed, and which request is due when; ``now`` is always the caller's."""

    def __init__(self, heartbeat_seconds: float, backoff: Backoff) -> None:
        self._heartbeat_seconds = heartbeat_seconds
        self._backoff = backoff
        self._replicas: dict[tuple[str, str], _Replica] = {}
        self._versions = itertools.count(1)
        self._retry_at = -math.inf
        # Nothing answered since a failure: the log warns once per outage, and the end of one checks the replicas.
        self.failing = False

    def offer(self, update: Update) -> None:
        """Take ``update`` as the newest state of its engine (and labels)."""
        key = (update.deployment, update.replica)
        replica = self._replicas.setdefault(key, _Replica(update.deployment, update.replica))
        if update.config != replica.config:
            replica.config = update.config
            replica.config_version = next(self._versions)
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
        for replica in self._replicas.values():
            deployment, name = replica.deployment, replica.name
            if replica.config_version != replica.config_delivered:
                call = sender.cache_config_call(deployment, replica.config or {}, name, heartbeat=interval)
                return Attempt(deployment, name, "config", 0, replica.config_version, call)
            for index, (version, payload) in replica.engines.items():
                if replica.engines_delivered.get(index) != version:
                    call = sender.ready_call(deployment, payload, "msgpack", name, heartbeat=interval)
                    return Attempt(deployment, name, "engine", index, version, call)
        replica = min(self._replicas.values(), key=lambda replica: replica.next_heartbeat, default=None)
        if replica is None or replica.next_heartbeat > now:
            return math.inf if replica is None else replica.next_heartbeat - now
        call = sender.heartbeat_call(replica.deployment, replica.name, interval)
        return Attempt(replica.deployment, replica.name, "heartbeat", 0, 0, call)

    def record(self, attempt: Attempt, outcome: sender.Outcome, now: float) -> Verdict:
        """Take what came of ``attempt``, answered at ``now``; the verdict is for the caller's log."""
        verdict = verdict_of(attempt, outcome)
        replica = self._replicas[(attempt.deployment, attempt.replica)]
        if verdict is Verdict.RETRY:
            self._retry_at = now + self._backoff.failed()
            self.failing = True
        elif verdict is Verdict.NOT_HELD:
            replica.forget_delivery()
            self._answered(now)
        else:
            self._done(replica, attempt, verdict is Verdict.DELIVERED, now)
            if verdict is Verdict.DELIVERED:
                self._answered(now)
            elif verdict is Verdict.REFUSED:
                # Logged as a failure is: the next answer ends it.
                self.failing = True
        return verdict

    def goodbyes(self) -> list[sender.Call]:
        """A goodbye for each replica the exporter holds (vLLM shuts down cleanly)."""
        return [
            sender.goodbye_call(replica.deployment, replica.name) for replica in self._replicas.values() if replica.held
        ]

    def _done(self, replica: _Replica, attempt: Attempt, accepted: bool, now: float) -> None:
        """``attempt``'s item is delivered (or refused for good): only a newer version goes again."""
        if attempt.kind == "config":
            replica.config_delivered = attempt.version
        elif attempt.kind == "engine" and attempt.engine in replica.engines:
            replica.engines_delivered[attempt.engine] = attempt.version
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
