"""The pages a person opens in a browser: ``/`` (status) and ``/docs`` (API reference).

Both are rendered on the server as plain HTML with inline CSS, so they work on an air-gapped host and
without JavaScript. The status page reads the same views as the JSON API, without the keys each engine
sent (it does not show them). It is built in a worker thread, never on the event loop, and kept until the
state, the store's health or the ``AGE_SECONDS`` step of its "ago" texts changes: a flood of ``GET /``
costs a send of the same bytes.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from html import escape
from typing import Any
from urllib.parse import quote

from exporter import __version__
from exporter.exposition.views import ReplicaView, view
from exporter.state.exporter_state import ExporterState
from exporter.state.replicas import Replica, ReplicaKey
from protocol import EngineFigures

# Beyond this many replicas the page lists the first ones and points at the JSON for the rest.
MAX_LISTED_REPLICAS = 500
# A cached page's "(N s ago)" texts are at most this many seconds old.
AGE_SECONDS = 5
_FIELDS = ("block_size", "mamba_block_size")
_STYLE = """
body{font-family:system-ui,sans-serif;margin:2rem;color:#1b1f24;max-width:72rem}
h1{font-size:1.5rem}h2{font-size:1.2rem;margin-top:2rem}
nav a{margin-right:1rem}table{border-collapse:collapse;margin:.5rem 0}
th,td{border:1px solid #c9ced6;padding:.25rem .6rem;text-align:right}th{background:#eef1f5}
td.name,th.name{text-align:left}.differs{background:#ffe3e3;font-weight:bold}
.warning{border-left:4px solid #d33;padding:.5rem 1rem;background:#fff5f5}
.muted{color:#59636e}code{background:#eef1f5;padding:0 .2rem}.vllm{color:#a40e26;font-weight:normal}
"""


def _page(title: str, body: str) -> str:
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_STYLE}</style></head>'
        f"<body>{body}</body></html>"
    )


def _when(timestamp: float, now: float) -> str:
    moment = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(timestamp))
    age = max(0, int(now - timestamp))
    ago = f"{age} s" if age < 120 else f"{age // 60} min" if age < 7200 else f"{age // 3600} h"
    return f'<time datetime="{time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))}">{moment}</time> ({ago} ago)'


def _value(value: object) -> str:
    return "—" if value is None else escape(str(value))


def _anchor(replica: ReplicaView) -> str:
    return escape(f"replica-{quote(replica.deployment, safe='')}-{quote(replica.replica, safe='')}")


def _title(replica: ReplicaView) -> str:
    return f"{escape(replica.deployment)} · {escape(replica.replica)}"


def _disagreements(deployment: ReplicaView) -> list[str]:
    """One sentence per field on which the engines of a replica report different values."""
    sentences = []
    for field in _FIELDS:
        if deployment.distinct_values.get(field, 1) > 1:
            values = ", ".join(
                f"engine {engine.engine}: {_value(getattr(engine.figures, field))}" for engine in deployment.engines
            )
            sentences.append(
                f'<a href="#{_anchor(deployment)}"><code>{_title(deployment)}</code></a>: '
                f"{field} differs ({values}); "
                f"the lowest engine index's {_value(deployment.labels.get(field))} is published"
            )
    return sentences


def _groups(figures: EngineFigures) -> str:
    """The engine core's groups in its order, each ``kind block_size``, a drafter's marked."""
    if figures.kv_cache_groups is None:
        return '<span class="muted">not reported</span>'
    return ", ".join(
        f"{escape(group.kind)} {group.block_size}" + (" (draft)" if group.draft else "")
        for group in figures.kv_cache_groups.groups
    )


def _vllm_differs(figures: EngineFigures) -> bool:
    """Whether vLLM's own ``cache_config_info`` shows this engine another ``mamba_block_size`` than it runs."""
    return figures.vllm_mamba_block_size is not None and figures.vllm_mamba_block_size != figures.mamba_block_size


def _vllm_shows(value: object) -> str:
    """vLLM's own, wrong figure, beside the true one."""
    title = "what vLLM's own vllm:cache_config_info shows"
    return f' <span class="vllm" title="{escape(title)}">(vLLM shows {_value(value)})</span>'


def _replica_section(deployment: ReplicaView, now: float) -> str:
    json_link = "/api/v1/deployments/" + quote(deployment.deployment, safe="/")
    expected = deployment.data_parallel_size
    reporting = f"{len(deployment.engines)}" + (f" of {expected}" if expected is not None else "")
    rows = []
    for engine in deployment.engines:
        figures = engine.figures
        cells = []
        for field in _FIELDS:
            value = getattr(figures, field)
            differs = deployment.distinct_values.get(field, 1) > 1 and str(value) != deployment.labels.get(field)
            shown = _value(value)
            if field == "mamba_block_size" and _vllm_differs(figures):
                shown += _vllm_shows(figures.vllm_mamba_block_size)
            cells.append(f'<td class="differs">{shown}</td>' if differs else f"<td>{shown}</td>")
        rows.append(
            f"<tr><td>{engine.engine}</td>{''.join(cells)}<td>{_value(figures.num_gpu_blocks)}</td>"
            f'<td>{_value(figures.max_model_len)}</td><td class="name">{_groups(figures)}</td>'
            f'<td class="name">{_when(engine.received_at, now)}</td></tr>'
        )
    wrong = {engine.figures.vllm_mamba_block_size for engine in deployment.engines if _vllm_differs(engine.figures)}
    return (
        f'<section class="deployment"><h2 id="{_anchor(deployment)}">{_title(deployment)}</h2>'
        f"<p>block_size <strong>{_value(deployment.labels.get('block_size'))}</strong>, "
        f"mamba_block_size <strong>{_value(deployment.labels.get('mamba_block_size'))}</strong>"
        f"{''.join(_vllm_shows(value) for value in sorted(wrong, key=str))}, "
        f"engines reporting: {reporting}, vLLM {escape(deployment.vllm_release)}, "
        f"last seen {_when(deployment.last_seen, now)} "
        f'· <a href="{escape(json_link)}">JSON</a></p>'
        "<table><tr><th>engine</th><th>block size</th><th>mamba block size</th><th>GPU blocks</th>"
        '<th>max model len</th><th class="name">KV-cache groups: block size</th><th class="name">last report</th></tr>'
        f"{''.join(rows)}</table></section>"
    )


def status_page(
    replicas: Mapping[ReplicaKey, Replica], telemetry_path: str, now: float, storage_error: str | None
) -> str:
    """``/``: every replica's true block sizes per engine, when each last reported, and disagreements."""
    keys = sorted(replicas)
    views = [view(replicas[key], responses=False) for key in keys[:MAX_LISTED_REPLICAS]]
    engines = sum(len(replica.engines) for replica in replicas.values())
    deployments = {key[0] for key in keys}
    links = (
        f'<nav><a href="{escape(telemetry_path)}">Metrics</a><a href="/api/v1/deployments">Deployments (JSON)</a>'
        '<a href="/docs">API documentation</a><a href="/-/healthy">Health</a><a href="/-/ready">Readiness</a></nav>'
    )
    parts = [
        f"<h1>cache-config-exporter {escape(__version__)}</h1>",
        "<p>The KV-cache configuration vLLM engines really run with, synced from their ready responses.</p>",
        links,
        f'<p id="summary">{len(deployments)} deployment(s), {len(keys)} replica(s), {engines} engine(s).</p>',
    ]
    if storage_error is not None:
        parts.append(f'<p class="warning">Storage failing: {escape(storage_error)}. Ingest answers 503.</p>')
    sentences = [sentence for deployment in views for sentence in _disagreements(deployment)]
    if sentences:
        items = "".join(f"<li>{sentence}</li>" for sentence in sentences)
        parts.append(
            f'<section id="disagreements" class="warning"><h2>Engines that disagree</h2><ul>{items}</ul></section>'
        )
    if not replicas:
        parts.append('<p class="muted">No engine has reported yet.</p>')
    parts.extend(_replica_section(replica, now) for replica in views)
    if len(keys) > MAX_LISTED_REPLICAS:
        hidden = len(keys) - MAX_LISTED_REPLICAS
        parts.append(f'<p class="muted">{hidden} more replica(s): see <a href="/api/v1/deployments">the JSON</a>.</p>')
    return _page("cache-config-exporter", "".join(parts))


class StatusPage:
    """``/`` as UTF-8, built at most once per state version, store health and ``AGE_SECONDS`` step."""

    def __init__(self, state: ExporterState, telemetry_path: str, clock: Callable[[], float]) -> None:
        self._state = state
        self._telemetry_path = telemetry_path
        self._clock = clock
        self._built: tuple[tuple[int, str | None, int], bytes] | None = None
        self._lock = threading.Lock()

    def _key(self) -> tuple[int, str | None, int]:
        return self._state.version, self._state.storage_error, int(self._clock() // AGE_SECONDS)

    def fresh(self) -> bytes | None:
        """The page if it is still current, else ``None`` (a cheap look, for the event loop)."""
        built = self._built
        return built[1] if built is not None and built[0] == self._key() else None

    def current(self) -> bytes:
        """The page, built first when it is no longer current (readers meanwhile wait for that one build)."""
        with self._lock:
            key = self._key()  # the version before the snapshot: the snapshot is then at least that new
            if self._built is None or self._built[0] != key:
                page = status_page(self._state.snapshot(), self._telemetry_path, self._clock(), key[1])
                self._built = (key, page.encode())
            return self._built[1]


def _inline(markdown: str) -> str:
    """The OpenAPI document's CommonMark text as HTML: escaped, with its `literals` as ``<code>``."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escape(markdown))


def _kind(schema: dict[str, Any]) -> str:
    """A parameter's JSON Schema in a few words: its types, and its default."""
    types = [option.get("type", "?") for option in schema.get("anyOf", [schema]) if option.get("type") != "null"]
    default = schema.get("default")
    return " or ".join(types) + (f" (default {escape(str(default))})" if default not in (None, "") else "")


def _operation(method: str, path: str, operation: dict[str, Any]) -> str:
    """One operation: what it does, its parameters, what it takes and what it answers."""
    rows = "".join(
        f'<tr><td class="name"><code>{escape(parameter["name"])}</code></td><td class="name">{parameter["in"]}</td>'
        f'<td class="name">{"yes" if parameter.get("required") else "no"}</td>'
        f'<td class="name">{_kind(parameter["schema"])}</td>'
        f'<td class="name">{_inline(parameter.get("description", ""))}</td></tr>'
        for parameter in operation.get("parameters", [])
    )
    parameters = (
        '<table><tr><th class="name">parameter</th><th class="name">in</th><th class="name">required</th>'
        f'<th class="name">type</th><th class="name">meaning</th></tr>{rows}</table>'
        if rows
        else ""
    )
    body = operation.get("requestBody", {}).get("content", {})
    takes = f"<p>Body: {', '.join(f'<code>{escape(media)}</code>' for media in body)}</p>" if body else ""
    answers = "; ".join(
        f"<code>{escape(status)}</code> "
        + (", ".join(f"<code>{escape(media)}</code>" for media in answer.get("content", {})) or "no body")
        for status, answer in operation.get("responses", {}).items()
    )
    return (
        f'<section id="{escape(operation["operationId"])}"><h2><code>{escape(method.upper())}</code> '
        f"<code>{escape(path)}</code></h2><p>{_inline(operation.get('summary', ''))}</p>{parameters}{takes}"
        f"<p>Answers: {answers}</p></section>"
    )


def api_reference(openapi: dict[str, Any]) -> str:
    """``/docs``: every operation of the OpenAPI document, without Swagger UI's scripts from a CDN."""
    operations = [
        (method, path, operation)
        for path, methods in openapi.get("paths", {}).items()
        for method, operation in methods.items()
    ]
    index = "".join(
        f'<tr><td class="name"><code>{escape(method.upper())}</code></td>'
        f'<td class="name"><a href="#{escape(operation["operationId"])}"><code>{escape(path)}</code></a></td>'
        f'<td class="name">{_inline(operation.get("summary", ""))}</td></tr>'
        for method, path, operation in operations
    )
    body = (
        f"<h1>{escape(openapi['info']['title'])} {escape(openapi['info']['version'])}: HTTP API</h1>"
        '<nav><a href="/">Status</a><a href="/openapi.json">OpenAPI document (JSON)</a></nav>'
        "<p>A refused request is answered with <code>application/problem+json</code> (RFC 9457), naming the field "
        "at fault and why.</p>"
        '<table><tr><th class="name">method</th><th class="name">path</th><th class="name">what it does</th></tr>'
        f"{index}</table>{''.join(_operation(method, path, operation) for method, path, operation in operations)}"
    )
    return _page("cache-config-exporter API", body)
