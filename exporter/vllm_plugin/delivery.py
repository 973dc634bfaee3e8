"""One exporter's delivery thread: sends what the outbox says is due, logs what failed once per run of
failures, and says goodbye last. A daemon thread per exporter URL, so that an exporter away never delays
another."""

from __future__ import annotations

import logging
import math
import threading
import time

from exporter.vllm_plugin import sender
from exporter.vllm_plugin.outbox import Attempt, Backoff, Outbox, Update, Verdict, outcomes_of, verdict_of
from exporter.vllm_plugin.target import TOKEN_FILE_VARIABLE, Target
from protocol import tokens

# Backoff while an exporter is away (``outbox.Backoff``): doubling from the first wait up to the cap, and
# never beyond one heartbeat interval, so that an exporter that is back has the whole state within one interval.
FIRST_RETRY_SECONDS = 0.5
MAX_RETRY_SECONDS = 30.0
# The engines of a data-parallel server report within moments of each other as they start: what they report
# within this window of the first goes in one request.
BATCH_WINDOW_SECONDS = 1.0
# The goodbye's own deadline, shorter than the timeout: vLLM's shutdown waits for it, at most this long.
GOODBYE_SECONDS = 0.3
logger = logging.getLogger("vllm.cache_config_exporter")


class Delivery:
    """Delivers one replica's state to one exporter from its own daemon thread, until delivered or superseded.

    What is due when, and what an answer means, is the ``Outbox``'s; this holds the thread, the lock, the clock
    and the log.
    """

    def __init__(self, url: str, target: Target) -> None:
        self.url = url
        self._target = target
        self._condition = threading.Condition()
        backoff = Backoff(FIRST_RETRY_SECONDS, MAX_RETRY_SECONDS, target.heartbeat_seconds)
        self._outbox = Outbox(target.heartbeat_seconds, backoff, BATCH_WINDOW_SECONDS)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._goodbye = False
        self._refusals: set[tuple[str, str]] = set()
        self._token: str | None = None
        # The delivery thread's alone: the plugin's heartbeats reuse one connection.
        self._connection = sender.Connection(url, target.timeout_seconds, client="vllm-plugin")

    def offer(self, update: Update) -> None:
        """Take ``update`` as the newest state of its engine (and labels); never blocks on the exporter."""
        with self._condition:
            if self._closed:
                return
            self._outbox.offer(update, time.monotonic())
            # ``is_alive`` is False in a child forked after the thread started.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"cache-config-exporter {self.url}", daemon=True)
                self._thread.start()
            self._condition.notify_all()

    def backlog(self) -> int:
        """How many items (labels, ready responses) this exporter has still to take."""
        with self._condition:
            return self._outbox.backlog()

    def flush(self, timeout: float) -> bool:
        """Wait until this exporter holds everything offered; False on timeout."""
        with self._condition:
            return self._condition.wait_for(lambda: self._closed or not self._outbox.backlog(), timeout)

    def close(self) -> threading.Thread | None:
        """Stop after the request in flight, without goodbye; the thread, to wait for it."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
            return self._thread

    def close_with_goodbye(self) -> threading.Thread | None:
        """Stop after the request in flight, then remove the replicas the exporter holds; the thread that says
        the goodbye, to wait for it. ``None`` when no goodbye goes: the exporter holds none of them, or it did
        not answer the last attempt (an exporter away would only make vLLM's shutdown wait; the replica expires
        once its heartbeats are missed)."""
        with self._condition:
            self._goodbye = not self._outbox.failing and bool(self._outbox.goodbyes())
            thread = self.close()
            return thread if self._goodbye else None

    def _run(self) -> None:
        """The thread: make each request once it is due and record what came of it, until closed."""
        while (attempt := self._next_attempt()) is not None:
            outcome = self._send(attempt.call)
            with self._condition:
                failing = self._outbox.failing
                verdict = self._outbox.record(attempt, outcome, time.monotonic())
                self._condition.notify_all()
            self._log(attempt, outcome, verdict, failing)
        with self._condition:
            calls = self._outbox.goodbyes() if self._goodbye else []
        self.leave(calls)

    def _next_attempt(self) -> Attempt | None:
        """The next request to make, once it is due; ``None`` when closed."""
        with self._condition:
            while not self._closed:
                due = self._outbox.due(time.monotonic())
                if isinstance(due, Attempt):
                    return due
                self._condition.wait(None if due == math.inf else due)
        return None

    def _log(self, attempt: Attempt, outcome: sender.CallResult, verdict: Verdict, failing: bool) -> None:
        """What came of ``attempt`` (``failing`` since an earlier one), in vLLM's log."""
        # Of several ready responses, the first one not taken says why.
        outcome = next(
            (item for item in outcomes_of(attempt, outcome) if verdict_of(attempt, item) is verdict), outcome
        )
        if verdict is Verdict.LABELS_REFUSED and isinstance(outcome, sender.Rejected):
            self._refused(attempt.deployment, outcome)
        elif verdict in (Verdict.RETRY, Verdict.REFUSED):
            self._report(self._described(attempt.call, outcome), first=not failing)
        elif verdict is Verdict.SPLIT:
            logger.info(
                "cache-config-exporter: %s did not say of each of %d ready responses in one request whether it "
                "took it (%s); sending one a request",
                self.url,
                len(attempt.versions),
                f"an answer longer than {sender.ANSWER_BYTES} bytes"
                if isinstance(outcome, sender.Accepted)
                else outcome,
            )
        else:
            if verdict is Verdict.NOT_HELD:
                logger.info(
                    "cache-config-exporter: %s does not hold replica %r of %r; sending its state again",
                    self.url,
                    attempt.replica,
                    attempt.deployment,
                )
            if failing:
                logger.info("cache-config-exporter: %s is reachable again", self.url)

    def leave(self, goodbyes: list[sender.Call]) -> None:
        """Say the ``goodbyes`` that remove this server's replicas from the exporter (vLLM is shutting down
        cleanly), one attempt each, all within ``GOODBYE_SECONDS``, then close the connection: nothing more goes
        to this exporter. The delivery thread's last act; called from elsewhere only once that thread is gone or
        never ran."""
        deadline = time.monotonic() + min(GOODBYE_SECONDS, self._target.timeout_seconds)
        for call in goodbyes:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            outcome = self._send(call, left)
            if not isinstance(outcome, sender.Accepted):
                logger.debug(
                    "cache-config-exporter: goodbye failed: %s", self._redacted(self._described(call, outcome))
                )
        self._connection.close()

    def _send(self, call: sender.Call, timeout: float | None = None) -> sender.CallResult:
        """One request, with the token as it is now, within ``timeout`` (by default the target's); a token that
        cannot be sent counts as unreachable."""
        try:
            authorization = self._authorization()
        except tokens.TokenError as error:
            return sender.Unreachable(str(error))
        return self._connection.send(call, authorization=authorization, timeout=timeout)

    def _described(self, call: sender.Call, outcome: sender.CallResult) -> str:
        """What came of ``call``, for the log: the request, then the answer."""
        return f"{call.method} {self.url}{call.path}: {outcome}"

    def _authorization(self) -> str | None:
        """The bearer header, from the token file (read afresh, so it may rotate) or the token variable."""
        token = self._target.token
        if self._target.token_file:
            try:
                token = tokens.read_token(self._target.token_file)
            except tokens.TokenError as error:
                raise tokens.TokenError(f"cannot read {TOKEN_FILE_VARIABLE} {error}") from None
        if not token:
            return None
        self._token = token
        return tokens.bearer(token)

    def _refused(self, deployment: str, refusal: sender.Rejected) -> None:
        """One warning per refused field and reason: the value is neither dropped silently nor converted."""
        if (refusal.field or "", refusal.detail) in self._refusals:
            return
        self._refusals.add((refusal.field or "", refusal.detail))
        logger.warning(
            "cache-config-exporter: %s refused the cache config of %r because of field %r: %s. "
            "Its ready responses are still forwarded, but the exporter does not show this field as vLLM has it.",
            self.url,
            deployment,
            refusal.field,
            refusal.detail,
        )

    def _redacted(self, message: str) -> str:
        return message.replace(self._token, "<token>") if self._token else message

    def _report(self, message: str, first: bool) -> None:
        """One warning per outage: the ``first`` failure warns, the next ones are debug until a send succeeds."""
        message = self._redacted(message)
        if not first:
            logger.debug("cache-config-exporter: %s", message)
            return
        logger.warning(
            "cache-config-exporter: %s. vLLM is not affected; the newest state of this vLLM server is kept and "
            "retried until the exporter takes it; further failures are logged at debug level until a send succeeds.",
            message,
        )
