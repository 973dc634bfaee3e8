"""Compare the stand-in ``vllm`` package (tests/vllm_standin) with the installed real vLLM; print the differences.

Run with the Python of the vLLM venv, from the repository: ``python -m tests.real_vllm.compare_standin``.
Prints a JSON list of differences (empty when the stand-in matches): module paths,
``CacheConfig.metrics_info()`` (labels, order and values, for vLLM's defaults and
for a hybrid model's settings), ``EngineCoreReadyResponse``'s fields with their
defaults, and the signatures of the methods the plugin wraps (``MPClient._apply_ready_response``, whose effect
is compared too, ``MPClient.shutdown``, ``EngineCoreProc._make_ready_response`` and
``APIServerProcessManager.shutdown``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from tests.real_vllm.frontend import HYBRID_RESPONSE, frontend_client

STANDIN = Path(__file__).resolve().parent.parent / "vllm_standin"
MODULES = (
    "vllm.config", "vllm.config.cache", "vllm.engine.arg_utils", "vllm.v1.engine", "vllm.v1.engine.core",
    "vllm.v1.engine.core_client", "vllm.v1.utils",
)  # fmt: skip
# The methods the plugin wraps, by module and class.
WRAPPED = (
    ("vllm.v1.engine.core_client", "MPClient", "_apply_ready_response"),
    ("vllm.v1.engine.core_client", "MPClient", "shutdown"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_make_ready_response"),
    ("vllm.v1.utils", "APIServerProcessManager", "shutdown"),
)
CACHE_CONFIGS: list[dict[str, Any]] = [
    {},
    {"block_size": 32, "mamba_cache_mode": "align", "enable_prefix_caching": True},
]


def standin_module(name: str) -> ModuleType:
    """A stand-in module loaded from its file under a name of its own, beside the real ``vllm``."""
    relative = Path(*name.split("."))
    path = STANDIN / relative / "__init__.py"
    if not path.exists():
        path = (STANDIN / relative).with_suffix(".py")
    spec = importlib.util.spec_from_file_location(f"standin_{name.replace('.', '_')}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Dataclasses look their module up while they are built.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def relative_path(module: ModuleType, root: Path) -> Path:
    return Path(module.__file__ or "").resolve().relative_to(root)


def fields_of(response_class: type) -> list[tuple[str, str]]:
    """Each field's name and default (``required`` for none), in order."""
    return [
        (field.name, "required" if field.default is dataclasses.MISSING else repr(field.default))
        for field in dataclasses.fields(response_class)
    ]


def applied(client_class: type, cache_config: Any) -> dict[str, str]:
    """``metrics_info()`` after ``client_class``'s ``_apply_ready_response`` ran on two engines' responses."""
    engine = importlib.import_module("vllm.v1.engine")
    client = frontend_client(client_class, cache_config, "m")
    for rank in (0, 1):
        response = engine.EngineCoreReadyResponse(**{**HYBRID_RESPONSE, "data_parallel_rank": rank})
        client._apply_ready_response(msgspec.msgpack.encode(response))
    return cache_config.metrics_info()


def differences() -> list[str]:
    found = []
    real_root = Path(importlib.import_module("vllm").__file__ or "").resolve().parent.parent
    for name in MODULES:
        real = relative_path(importlib.import_module(name), real_root)
        if not (STANDIN / real).is_file():
            found.append(f"{name}: real vLLM has it in {real}, the stand-in does not")

    real_cache, standin_cache = importlib.import_module("vllm.config").CacheConfig, standin_module("vllm.config.cache")
    for arguments in CACHE_CONFIGS:
        real_info = list(real_cache(**arguments).metrics_info().items())
        standin_info = list(standin_cache.CacheConfig(**arguments).metrics_info().items())
        if real_info != standin_info:
            found.append(f"CacheConfig({arguments}).metrics_info(): real {real_info}, stand-in {standin_info}")
        real_synced = applied(importlib.import_module("vllm.v1.engine.core_client").MPClient, real_cache(**arguments))
        standin_synced = applied(
            standin_module("vllm.v1.engine.core_client").MPClient, standin_cache.CacheConfig(**arguments)
        )
        if real_synced != standin_synced:
            found.append(f"after _apply_ready_response, real {real_synced}, stand-in {standin_synced}")

    real_fields = fields_of(importlib.import_module("vllm.v1.engine").EngineCoreReadyResponse)
    standin_fields = fields_of(standin_module("vllm.v1.engine").EngineCoreReadyResponse)
    if real_fields != standin_fields:
        found.append(f"EngineCoreReadyResponse fields: real {real_fields}, stand-in {standin_fields}")

    for module, class_name, method in WRAPPED:
        real = getattr(getattr(importlib.import_module(module), class_name), method)
        standin = getattr(getattr(standin_module(module), class_name), method)
        real_signature = inspect.signature(real, eval_str=True)
        standin_signature = inspect.signature(standin, eval_str=True)
        if real_signature != standin_signature:
            found.append(f"{class_name}.{method}{real_signature} vs stand-in{standin_signature}")
    return found


if __name__ == "__main__":
    json.dump(differences(), sys.stdout, indent=1)
