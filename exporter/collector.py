"""Collects each deployment's state into exposition lines: ``cache_config_info`` and its numeric companions.

A deployment is rendered once per change (deployments are immutable, so the
rendered lines are cached by identity) and a scrape only joins the cached
lines. Every scrape still reflects the current state: a changed label set or a
dropped engine leaves no stale series behind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from exporter.state import Deployment


@dataclass(frozen=True)
class Family:
    suffix: str
    help: str


INFO = Family(
    "info",
    "Information of the LLMEngine CacheConfig: the labels of the sending vLLM release, synced from the engines' "
    "ready responses, with the block sizes the engines really run with.",
)
# Per-engine figures, each named after the ready-response field it reports.
ENGINE_GAUGES = (
    Family("block_size", "KV-cache block size in tokens this engine runs with."),
    Family("mamba_block_size", "Mamba block size in tokens this engine runs with (absent without Mamba layers)."),
    Family(
        "vllm_mamba_block_size",
        "mamba_block_size as vLLM's own cache_config_info shows it for this engine (the engine core's report from "
        "0.29, the configured value before); where it differs from cache_config_mamba_block_size, vLLM's is wrong.",
    ),
    Family("num_gpu_blocks", "GPU KV-cache blocks of this engine alone (the info metric shows the deployment total)."),
    Family("max_model_len", "Longest sequence this engine accepts, in tokens."),
    Family("kv_cache_size_tokens", "KV-cache capacity of this engine in tokens."),
    Family("kv_cache_max_concurrency", "Requests of max_model_len this engine's KV cache can hold at once."),
)
UPDATED = Family(
    "last_update_timestamp_seconds", "When this engine's last ready response was accepted, in Unix seconds."
)
DISTINCT = Family(
    "distinct_values",
    "Distinct values the engines of a deployment report for a field; above 1 they disagree and the lowest "
    "engine index wins.",
)
PARALLEL = Family("data_parallel_size", "Data-parallel size the engines of a deployment report (the largest).")
FAMILIES = (INFO, *ENGINE_GAUGES, UPDATED, DISTINCT, PARALLEL)


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: float) -> str:
    """Formatted as prometheus_client formats it (``1056.0``, ``2.108832e+06``), so output matches vLLM's."""
    return floatToGoString(float(value))


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    return ",".join(f'{name}="{escape_label_value(value)}"' for name, value in pairs)


def render_deployment(deployment: Deployment, prefix: str) -> tuple[bytes, ...]:
    """The lines of one deployment, one bytes string per family of ``FAMILIES`` (in that order)."""
    lines: dict[Family, list[str]] = {family: [] for family in FAMILIES}
    if deployment.engines:
        name = f"{prefix}cache_config_"
        info_labels = _labels(deployment.synced.labels.items())
        deployment_label = f'deployment="{escape_label_value(deployment.name)}"'
        for engine in sorted(deployment.engines):
            key = f'{deployment_label},engine="{engine}"'
            lines[INFO].append(f"{name}info{{{key},{info_labels}}} 1.0\n")
            figures = deployment.synced.engines[engine]
            for family in ENGINE_GAUGES:
                value = getattr(figures, family.suffix)
                if value is not None:
                    lines[family].append(f"{name}{family.suffix}{{{key}}} {format_value(value)}\n")
            received = deployment.engines[engine].received_at
            lines[UPDATED].append(f"{name}{UPDATED.suffix}{{{key}}} {format_value(received)}\n")
        for field, count in deployment.synced.distinct_values.items():
            lines[DISTINCT].append(
                f'{name}{DISTINCT.suffix}{{{deployment_label},field="{field}"}} {format_value(count)}\n'
            )
        parallel = deployment.synced.data_parallel_size
        if parallel is not None:
            lines[PARALLEL].append(f"{name}{PARALLEL.suffix}{{{deployment_label}}} {format_value(parallel)}\n")
    return tuple("".join(lines[family]).encode() for family in FAMILIES)


class CacheConfigCollector:
    """Renders the cache-config families of every deployment, re-rendering only deployments that changed."""

    def __init__(self, prefix: str = "") -> None:
        self._prefix = prefix
        self._headers = tuple(
            f"# HELP {prefix}cache_config_{family.suffix} {family.help}\n"
            f"# TYPE {prefix}cache_config_{family.suffix} gauge\n".encode()
            for family in FAMILIES
        )
        self._rendered: dict[str, tuple[Deployment, tuple[bytes, ...]]] = {}

    def collect(self, deployments: Mapping[str, Deployment]) -> bytes:
        """The exposition of all ``deployments``; only called from one thread at a time."""
        rendered: dict[str, tuple[Deployment, tuple[bytes, ...]]] = {}
        for name in sorted(deployments):
            deployment = deployments[name]
            cached = self._rendered.get(name)
            rendered[name] = cached if cached and cached[0] is deployment else (
                deployment, render_deployment(deployment, self._prefix)
            )  # fmt: skip
        self._rendered = rendered
        parts = [entry[1] for entry in rendered.values()]
        return b"".join(
            self._headers[index] + b"".join(part[index] for part in parts) for index in range(len(FAMILIES))
        )
