"""Zero-install mode: ``/probe?target=HOST:PORT`` reads a stock vLLM server's ``/metrics`` and answers the true
cache config of that server, as Prometheus' multi-target exporters (blackbox_exporter, snmp_exporter) do.

vLLM shows, per engine, ``vllm:cache_config_info`` with its frontend's ``CacheConfig.metrics_info()`` labels.
Those labels name no release, but their set tells it: each release's set is in the release table
(``protocol/releases.py``). The figures that release's frontend copies from its engines' ready responses
(``applied_fields``: ``block_size``, ``num_gpu_blocks``, ``mamba_block_size``, ...) become one
``EngineCoreReadyResponse`` per engine; with the labels as the replica's static labels, the push path's own
sync (``protocol/sync.py``) and series (``exposition/series.py``, rendered by ``exposition/rendering.py``) make
the answer: the true ``mamba_block_size``, by the sync rule (``source="sync_rule"``), since the probe cannot
see the engine core's KV-cache groups. Families vLLM's ``/metrics`` gives nothing for (``max_model_len``) or
that describe pushes (report times, disagreeing engines) are left out, and so are per-engine figures where
vLLM shows only the server's (``num_gpu_blocks`` is summed over the engines, ``kv_cache_*`` are one engine's).

Stateless: nothing is stored. Every probe answers 200 with ``cache_config_probe_success`` and
``cache_config_probe_duration_seconds``; a target that cannot be read is ``success 0`` and a log line saying
why (``?debug=true`` answers the probe's whole log), naming what failed and where, never the target's bytes.
``cache_config_exporter_probes_total{result}`` counts them. Bounded whatever a target sends: the body is read
as it comes (``text_format.py``), in slices that take turns on the event loop and stop at the deadline
(``turns.py``); at most ``--probe.max-concurrent`` probes run, and one past them is refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.errors import ClientDisconnected, Refused
from exporter.exposition.formats import TEXT, negotiate
from exporter.exposition.lines import ReplicaLines
from exporter.exposition.series import FAMILIES
from exporter.exposition.shared_counts import SHARED_COUNTS_ENVIRONMENT, SharedCounter
from exporter.exposition.telemetry import MULTIPROCESS_ENVIRONMENT
from exporter.probe.addresses import addresses_of
from exporter.probe.allowlist import AllowList, ProbeTarget
from exporter.probe.client import MetricsClient, ProbeFailed
from exporter.probe.options import ProbeSettings, probe_flag
from exporter.probe.text_format import INFO, Shown, TextReader
from exporter.probe.turns import Turns
from exporter.state.replicas import Replica, build_replica, engine_report
from protocol import EngineCoreReadyResponse, InvalidPayload, Release, releases
from protocol.labels import check_labels
from protocol.names import DEFAULT_DEPLOYMENT, deployment_of_model
from protocol.ready_response import JSON

SUCCESS = "success"
# A probe whose client hung up before it ended: stopped there, answered to no one, but counted like the others.
CLIENT_LEFT = "client_left"
# Every result of a probe: success, or why it failed or ended unanswered.
RESULTS = (
    SUCCESS, "unreachable", "timeout", "too_large", "http_status", "not_vllm", "unknown_release", "invalid", CLIENT_LEFT
)  # fmt: skip
# Taken off Prometheus' scrape timeout, so that the answer arrives before Prometheus gives up (blackbox_exporter's
# --timeout-offset); at most half of a short timeout goes.
TIMEOUT_MARGIN_SECONDS = 0.5
# Families the probe does not publish: vLLM's /metrics shows no max_model_len, and the others describe pushes.
_NOT_SHOWN = frozenset(
    {"max_model_len", "last_update_timestamp_seconds", "last_seen_timestamp_seconds", "distinct_values"}
)
# vLLM's frontend shows these per server (num_gpu_blocks summed, kv_cache_* the first engine's): per engine, the
# probe knows them only for a server of one engine.
_SERVER_FIGURES = frozenset({"num_gpu_blocks", "kv_cache_size_tokens", "kv_cache_max_concurrency"})
# A ready response needs a max_model_len; vLLM's /metrics has none, and its family is not published.
_UNSHOWN_MAX_MODEL_LEN = 1
_log = logging.getLogger("cache_config_exporter")
_MAX_RUNNING_FLAG = probe_flag("probe_max_concurrent")
BUSY_WARNING_SECONDS = 10.0


class TooManyProbes(Refused):
    """A probe past ``--probe.max-concurrent``: answered at once (503, retry), never queued."""


@dataclass
class ProbeLog:
    """What one probe did, line by line, with the seconds since it began (``?debug=true`` answers it)."""

    started: float = field(default_factory=time.perf_counter)
    lines: list[str] = field(default_factory=list)

    def __call__(self, message: str) -> None:
        self.lines.append(f"{time.perf_counter() - self.started:.3f}s {message}")

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started


def release_of_labels(names: frozenset[str]) -> tuple[Release, str]:
    """The release whose ``metrics_info()`` labels these are, and how it was told (for the log).

    The newest release with exactly these labels; else the newest whose labels are all among them (a later
    build that added labels; they are counted, not named); else ``ProbeFailed`` naming the labels the nearest
    release has and these lack.
    """
    known = releases()
    exact = [release for release in known if frozenset(release.default_labels()) == names]
    if exact:
        versions = exact[0].version if len(exact) == 1 else f"{exact[0].version} to {exact[-1].version}"
        return exact[-1], f"the labels of vLLM {versions}"
    covered = [release for release in known if frozenset(release.default_labels()) <= names]
    if covered:
        extra = len(names - frozenset(covered[-1].default_labels()))  # counted: the target's names are not echoed
        return covered[-1], f"the labels of vLLM {covered[-1].version} and {extra} more: a later build"
    nearest = min(known, key=lambda release: (len(names ^ frozenset(release.default_labels())), release.key[::-1]))
    missing = sorted(frozenset(nearest.default_labels()) - names)
    raise ProbeFailed(
        "unknown_release",
        f"{INFO} has the labels of no vLLM release the exporter knows: the nearest, {nearest.version}, "
        f"also has {', '.join(missing)}",
    )


def read_vllm(
    shown: Shown, target: ProbeTarget, deployment: str | None, base_labels: Mapping[str, str], log: ProbeLog
) -> Replica:
    """The replica a vLLM server's ``/metrics`` shows, synced as a push of the same figures would be."""
    if not shown.engines:
        raise ProbeFailed("not_vllm", f"no {INFO} series: not a vLLM server, or one whose engines are not up yet")
    if deployment is None:
        # Named as the plugin names the same server: a model served by path after its folder.
        deployment = deployment_of_model(min(shown.models)) if shown.models else DEFAULT_DEPLOYMENT
        if len(shown.models) > 1:
            log(f"{len(shown.models)} different model_name values: the first in order names the deployment")
    for engine, count in sorted(shown.engines.items()):
        if count > 1:
            log(f"engine {engine} shows {count} different {INFO} label sets (several API servers?); the most "
                f"frequent is taken")  # fmt: skip
    lead = min(shown.engines)
    static = shown.labels
    if shown.engines_differ:
        log(f"the engines' {INFO} labels differ; engine {lead}'s are taken, as vLLM's frontend holds one config")
    release, how = release_of_labels(frozenset(static))
    log(f"{len(shown.engines)} engine(s) {sorted(shown.engines)}; {how}")
    try:
        check_labels(static)
        figures = {
            name: None if static[name] == "None" else static[name] for name in release.applied_fields if name in static
        }
        response = msgspec.convert(
            {**figures, "max_model_len": _UNSHOWN_MAX_MODEL_LEN, "vllm_version": release.version},
            EngineCoreReadyResponse,
            strict=False,
        )
    except (InvalidPayload, msgspec.ValidationError) as error:
        invalid = error if isinstance(error, InvalidPayload) else InvalidPayload.from_msgspec(error)
        raise ProbeFailed("invalid", _without_value(invalid, release)) from None
    # vLLM shows the engines' sum; each engine gets its share, so the sync's sum is vLLM's (no engine's is shown).
    count = len(shown.engines)
    now = time.time()
    responses = {
        engine: msgspec.structs.replace(
            response, num_gpu_blocks=response.num_gpu_blocks // count + (rank < response.num_gpu_blocks % count)
        )
        for rank, engine in enumerate(sorted(shown.engines))
    }
    engines = {engine: engine_report(engine, now, b"", JSON) for engine in responses}
    return build_replica((deployment, target.text), None, static, None, now, engines, base_labels, responses=responses)


def _without_value(invalid: InvalidPayload, release: Release) -> str:
    """An impossible label by the release's name for it and the rule its value breaks, never the value."""
    name = invalid.field.removeprefix("$.")
    shown, quoted, rule = invalid.reason.rpartition(" is not ")
    reason = f"its value is not {rule}" if quoted and shown[:1] in "'\"" else invalid.reason
    if name == "$":
        return f"the labels: {reason}"
    return f"label {name if name in release.default_labels() else 'of a later build'}: {reason}"


@dataclass(frozen=True)
class ProbeAnswer:
    """One probe's answer: the cache-config series (empty when it failed), its result, time and log."""

    result: str
    seconds: float
    series: bytes
    log: list[str]

    @property
    def success(self) -> bool:
        return self.result == SUCCESS

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The answer in the negotiated format (the series' lines are the same in both), and its content type."""
        served = negotiate(accept)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_ProbeMetrics(self))
        return self.series + served.render(registry), served.content_type

    def debug_text(self) -> str:
        """The probe's log and the text exposition it would have answered, as blackbox_exporter's ``debug=true``."""
        metrics = self.exposition(f"{TEXT.media_range}; version={TEXT.version}")[0].decode()
        log = "\n".join(self.log)
        return f"Logs for the probe:\n{log}\n\n\nMetrics that would have been returned:\n{metrics}"


class _ProbeMetrics(Collector):
    """blackbox_exporter's probe_success and probe_duration_seconds, under the exporter's names."""

    def __init__(self, outcome: ProbeAnswer) -> None:
        self._outcome = outcome

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "cache_config_probe_success",
            "1 when the probe read the target's vLLM cache config, 0 when not (the exporter's log says why).",
            value=float(self._outcome.success),
        )
        yield GaugeMetricFamily(
            "cache_config_probe_duration_seconds",
            "Seconds the probe took: resolving, connecting, reading and syncing.",
            value=self._outcome.seconds,
        )


async def _unless_departed(work: Coroutine[Any, Any, ProbeAnswer], departed: asyncio.Future[Any] | None) -> ProbeAnswer:
    """``work``'s outcome, or ``ClientDisconnected`` once ``departed`` is done first (``work`` is cancelled, and
    awaited: its connection to the target is closed before the slot is given back)."""
    if departed is None:
        return await work
    running = asyncio.ensure_future(work)
    await asyncio.wait((running, departed), return_when=asyncio.FIRST_COMPLETED)
    if running.done():
        return running.result()
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    raise ClientDisconnected(None, "the client hung up before the probe ended")


_RESULTS_HELP = "Probes of /probe, by result: success, or why the target's cache config could not be read."


def _results_counter(registry: CollectorRegistry) -> Callable[[str], None]:
    """How a probe's result is counted: in this process, in prometheus_client's multiprocess files
    (``--web.workers N``), or in the memory file of a probe-only exporter's workers (no writable directory)."""
    shared_counts = os.environ.get(SHARED_COUNTS_ENVIRONMENT)
    if shared_counts:
        shared = SharedCounter(shared_counts, "cache_config_exporter_probes", _RESULTS_HELP, "result", RESULTS)
        registry.register(shared)
        return shared.inc
    counter = Counter("cache_config_exporter_probes", _RESULTS_HELP, ["result"],
                      registry=None if os.environ.get(MULTIPROCESS_ENVIRONMENT) else registry)  # fmt: skip
    for result in RESULTS:
        counter.labels(result)
    return lambda result: counter.labels(result).inc()


class Prober:
    """Probes targets for ``/probe``: the allowlist, the HTTP client and the rendering, from the settings."""

    def __init__(self, settings: ProbeSettings, base_labels: Mapping[str, str], registry: CollectorRegistry) -> None:
        self.allowlist = AllowList.parse(settings.probe_allowed_targets)
        self.client = MetricsClient.from_settings(settings)
        self.max_seconds = settings.probe_timeout_seconds
        self.max_engines = settings.max_engines_per_replica
        self.max_engines_flag = settings.flag("max_engines_per_replica")
        self.max_running = settings.probe_max_concurrent
        self.running = 0
        self.turns = Turns()
        self.prefix = settings.metric_prefix
        self.info_labels = settings.info_labels()
        self.base_labels = dict(base_labels)
        self._warned_busy = -BUSY_WARNING_SECONDS
        self._count = _results_counter(registry)

    def timeout(self, scrape_timeout: float | None) -> float:
        """Seconds a probe may take: Prometheus' scrape timeout less the margin, at most ``--probe.timeout``."""
        if scrape_timeout is None:
            return self.max_seconds
        return min(self.max_seconds, max(scrape_timeout - TIMEOUT_MARGIN_SECONDS, scrape_timeout / 2))

    async def probe(
        self, target: ProbeTarget, deployment: str | None, timeout: float, departed: asyncio.Future[Any] | None = None
    ) -> ProbeAnswer:
        """Probe ``target``; raises ``TargetForbidden`` when the allowlist does not permit it, and
        ``TooManyProbes`` when ``--probe.max-concurrent`` probes are running (no queue: the client retries).

        ``departed``: done once the client has hung up; the probe then ends at once (``ClientDisconnected``), so
        that clients that ask and leave cannot keep the probe slots, and ``/probe``, taken for others.
        """
        self.allowlist.check(target)
        if self.running >= self.max_running:
            self._warn_busy()
            raise TooManyProbes(None, f"{self.running} probes are running, the most {_MAX_RUNNING_FLAG} allows; "
                                      "retry later")  # fmt: skip
        self.running += 1
        try:
            outcome = await _unless_departed(self._run(target, deployment, timeout), departed)
        except ClientDisconnected:
            self._count(CLIENT_LEFT)
            raise
        finally:
            self.running -= 1
        self._count(outcome.result)
        if outcome.success:
            _log.debug("probe of %s succeeded in %.3f s", target.text, outcome.seconds)
        else:
            _log.info("probe of %s failed (%s) in %.3f s: %s", target.text, outcome.result, outcome.seconds,
                      outcome.log[-1])  # fmt: skip
        return outcome

    async def _run(self, target: ProbeTarget, deployment: str | None, timeout: float) -> ProbeAnswer:
        """Everything a probe does, within ``timeout``: at the deadline it stops wherever it is."""
        log = ProbeLog()
        log(f"probing {self.client.scheme}://{target.text}/metrics, timeout {timeout:g} s")
        series, result = b"", SUCCESS
        try:
            async with asyncio.timeout(timeout):
                try:
                    addresses = await addresses_of(target)
                except OSError as error:
                    reason = error.strerror or error
                    raise ProbeFailed("unreachable", f"cannot resolve {target.host}: {reason}") from None
                body, turns = TextReader(self.max_engines, self.max_engines_flag), self.turns.of_probe()
                await self.client.fetch(target, addresses, log, turns, body)
                log(f"read {body.bytes_read} bytes")
                shown = await turns.run(body.finish())
            # At most --limits.engines-per-replica engines (their cost: docs/RELIABILITY.md, section 10), off the
            # loop; the request waits.
            series = await asyncio.to_thread(self._answer, shown, target, deployment, log)
        except ProbeFailed as failure:
            result = failure.result
            log(failure.detail)
        except TimeoutError:
            result = "timeout"
            log(f"no complete answer within {timeout:g} s")
        return ProbeAnswer(result, log.seconds, series, list(log.lines))

    def _warn_busy(self) -> None:
        """Say so, at most every ``BUSY_WARNING_SECONDS``: a flood of probes must not flood the log as well."""
        now = time.monotonic()
        if now - self._warned_busy >= BUSY_WARNING_SECONDS:
            self._warned_busy = now
            _log.warning("%d probes are running, the most %s allows: further probes get 503", self.running,
                         _MAX_RUNNING_FLAG)  # fmt: skip

    def _answer(self, shown: Shown, target: ProbeTarget, deployment: str | None, log: ProbeLog) -> bytes:
        """The cache-config series of what the target showed."""
        replica = read_vllm(shown, target, deployment, self.base_labels, log)
        labels = replica.synced.labels
        log(f"deployment {replica.deployment!r}: block_size {labels.get('block_size')}, "
            f"mamba_block_size {labels.get('mamba_block_size')}")  # fmt: skip
        return self._series(replica)

    def _series(self, replica: Replica) -> bytes:
        """The replica's cache-config lines as ``/metrics`` renders them, without the families the probe cannot know."""
        lines = ReplicaLines(self.prefix, self.info_labels)
        left_out = _NOT_SHOWN | (_SERVER_FIGURES if len(replica.engines) > 1 else frozenset())
        return b"".join(
            header + rendered
            for family, header, rendered in zip(FAMILIES, lines.headers, lines.of(replica), strict=True)
            if rendered and family.suffix not in left_out
        )
