"""The per-release vLLM tables: the generator's AST extraction, and the committed JSON it produced.

The extraction tests feed the generator small vLLM-shaped sources written into tmp_path (no network, no
vLLM). The label model (pydantic dataclass ``__dict__`` order, ``init=False`` and ``_``-prefixed fields,
the after-validator) is checked against real pydantic running the same synthetic ``CacheConfig``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import re
import sys
import textwrap
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from scripts import generate_vllm_releases as generator
from scripts.generate_vllm_releases import ExtractionError

COMMITTED = Path(__file__).resolve().parents[2] / "protocol" / "vllm_releases.json"
SURVEYED_RELEASES = (
    *("0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1"),
    *("0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
)

READY_RESPONSE_SOURCE = '''
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class EngineCoreReadyResponse:
    """Post-initialization config."""

    WIRE_NAME: ClassVar[str] = "ready"
    max_model_len: int
    dp_stats_address: str | None
    mamba_block_size: int | None = None
    enable_sleep_mode: bool = field(default=False)
    tags: list[str] = field(default_factory=list)
'''

CORE_CLIENT_SOURCE = """
import msgspec
from vllm.v1.engine import EngineCoreReadyResponse


class MPClient:
    def _apply_ready_response(self, payload: bytes) -> None:
        vllm_config = self.vllm_config
        ready = (
            msgspec.msgpack.decode(payload, type=EngineCoreReadyResponse)
            if payload
            else None
        )
        if ready is None:
            return
        vllm_config.model_config.max_model_len = min(
            vllm_config.model_config.max_model_len, ready.max_model_len
        )
        self._sources[ready.data_parallel_rank] = ready.kv_events_config
        vllm_config.cache_config.block_size = ready.block_size
        vllm_config.cache_config.max_model_len = ready.max_model_len
        for attribute in ("coordinator_input_address", "coordinator_output_address"):
            address = getattr(ready, attribute)
            setattr(self, attribute, address)
"""

CACHE_CONFIG_SOURCE = '''
from dataclasses import field
from typing import ClassVar

from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass


def config(cls):
    return dataclass(cls, config=ConfigDict(extra="forbid"))


@config
class CacheConfig:
    """A CacheConfig shaped like vLLM's."""

    DEFAULT_BLOCK_SIZE: ClassVar[int] = 64
    DEFAULT_GPU_MEMORY_UTILIZATION: ClassVar[float] = 0.92

    block_size: int = Field(default=None, gt=0)
    user_specified_block_size: bool = field(default=False, init=False)
    gpu_memory_utilization: float = Field(default=DEFAULT_GPU_MEMORY_UTILIZATION, gt=0, le=1)
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    kv_cache_dtype_skip_layers: list[str] = field(default_factory=list)
    mamba_block_size: int | None = Field(default=None, gt=0)
    num_gpu_blocks: int | None = field(default=None, init=False)
    kv_offloading_size: float | None = None

    def metrics_info(self):
        return {key: str(value) for key, value in self.__dict__.items()}

    _block_size_resolved: bool = field(default=False, init=False)

    @model_validator(mode="after")
    def _apply_block_size_default(self) -> "CacheConfig":
        if self._block_size_resolved:
            return self
        object.__setattr__(self, "_block_size_resolved", True)
        if self.block_size is None:
            self.block_size = self.DEFAULT_BLOCK_SIZE
        else:
            self.user_specified_block_size = True
        return self
'''


def _source(text: str, tmp_path: Path, name: str) -> str:
    """Writes a synthetic source file the way a wheel carries it and reads it back."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path.read_text()


def _import(path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Runs a synthetic source as a module (pydantic resolves annotations through sys.modules)."""
    spec = importlib.util.spec_from_file_location(f"synthetic_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_ready_response_fields_in_order_with_required_and_defaults(tmp_path: Path) -> None:
    table = generator.extract_ready_response(_source(READY_RESPONSE_SOURCE, tmp_path, "engine.py"))

    assert table["source"] == "vllm/v1/engine/__init__.py:7"
    assert table["fields"] == [
        {"name": "max_model_len", "annotation": "int", "required": True, "default": None},
        {"name": "dp_stats_address", "annotation": "str | None", "required": True, "default": None},
        {"name": "mamba_block_size", "annotation": "int | None", "required": False, "default": "None"},
        {"name": "enable_sleep_mode", "annotation": "bool", "required": False, "default": "False"},
        {"name": "tags", "annotation": "list[str]", "required": False, "default": "list()"},
    ]


def test_ready_response_that_is_no_longer_a_plain_dataclass_stops_the_run(tmp_path: Path) -> None:
    struct = READY_RESPONSE_SOURCE.replace("@dataclass\n", "").replace(
        "class EngineCoreReadyResponse:", "class EngineCoreReadyResponse(msgspec.Struct, array_like=True):"
    )
    with pytest.raises(ExtractionError, match="no longer a plain @dataclass"):
        generator.extract_ready_response(_source(struct, tmp_path, "engine.py"))


def test_applied_fields_in_first_read_order(tmp_path: Path) -> None:
    applied = generator.extract_applied_fields(_source(CORE_CLIENT_SOURCE, tmp_path, "core_client.py"))

    # The value of an assignment is read before its target's subscript; repeats count once.
    assert applied == [
        "max_model_len",
        "kv_events_config",
        "data_parallel_rank",
        "block_size",
        "coordinator_input_address",
        "coordinator_output_address",
    ]


def test_response_handed_elsewhere_stops_the_run(tmp_path: Path) -> None:
    escaping = CORE_CLIENT_SOURCE.replace("if ready is None:", "self._remember(ready)\n        if ready is None:")
    with pytest.raises(ExtractionError, match="escapes"):
        generator.extract_applied_fields(_source(escaping, tmp_path, "core_client.py"))


def test_cache_config_labels_match_pydantic_metrics_info(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _source(CACHE_CONFIG_SOURCE, tmp_path, "cache.py")
    table = generator.extract_cache_config(source)

    labels = {label["name"]: label["default"] for label in table["labels"]}
    assert table["default_block_size"] == 64
    assert table["source"] == "vllm/config/cache.py:14"
    assert labels == {
        "block_size": "64",
        "user_specified_block_size": "False",
        "gpu_memory_utilization": "0.92",
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "kv_cache_dtype_skip_layers": "[]",
        "mamba_block_size": "None",
        "num_gpu_blocks": "None",
        "kv_offloading_size": "None",
        "_block_size_resolved": "True",
    }
    # The same class run by real pydantic renders the same labels, in the same order.
    rendered = _import(tmp_path / "cache.py", monkeypatch).CacheConfig().metrics_info()
    assert list(rendered.items()) == list(labels.items())


def test_block_size_default_without_class_variable_comes_from_the_field(tmp_path: Path) -> None:
    older = CACHE_CONFIG_SOURCE.replace("DEFAULT_BLOCK_SIZE: ClassVar[int] = 64", "").replace(
        "block_size: int = Field(default=None, gt=0)", "block_size: int = Field(default=16, gt=0)"
    )
    older = older.replace("self.block_size = self.DEFAULT_BLOCK_SIZE", "pass")
    table = generator.extract_cache_config(_source(older, tmp_path, "cache.py"))

    assert table["default_block_size"] == 16
    assert table["labels"][0] == {"name": "block_size", "default": "16"}


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('cache_dtype: str = "auto"', "cache_dtype: str", "cache_dtype has no default"),
        ("default_factory=list", "default_factory=make_layers", "default_factory make_layers has no rule"),
        ('cache_dtype: str = "auto"', "cache_dtype: str = os.environ['X']", "not determinable statically"),
        ('"auto"', "Field(default='auto', validate_default=True)", "validate_default"),
        ("self.user_specified_block_size = True", "self.cache_dtype = 'fp8'", "also assigns"),
        (
            "    def metrics_info(self):",
            "    def __post_init__(self):\n        self.swap_space_bytes = 4\n\n    def metrics_info(self):",
            "__post_init__ has no rule",
        ),
    ],
    ids=["required-field", "unknown-factory", "dynamic-default", "validate-default", "validator-changed", "post-init"],
)
def test_defaults_not_known_statically_stop_the_run(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in CACHE_CONFIG_SOURCE
    source = _source(CACHE_CONFIG_SOURCE.replace(old, new), tmp_path, "cache.py")
    with pytest.raises(ExtractionError, match=message):
        generator.extract_cache_config(source)


def _fake_wheel(cache: Path, version: str) -> Path:
    """A wheel holding only the three files the generator reads, as if pip had cached it."""
    wheel = cache / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(generator.READY_RESPONSE_FILE, READY_RESPONSE_SOURCE)
        archive.writestr(generator.CORE_CLIENT_FILE, CORE_CLIENT_SOURCE)
        archive.writestr(generator.CACHE_CONFIG_FILE, CACHE_CONFIG_SOURCE)
    return wheel


def test_one_new_release_is_added_and_the_others_kept(tmp_path: Path) -> None:
    cache = tmp_path / "wheels"
    cache.mkdir()
    wheel = _fake_wheel(cache, "9.1.0")
    output = tmp_path / "vllm_releases.json"
    kept = {"version": "9.0.0", "wheel": "kept.whl"}
    later = {"version": "9.10.0", "wheel": "later.whl"}
    output.write_text(json.dumps({"releases": [later, kept]}))

    assert generator.main(["9.1.0", "--output", str(output), "--wheel-cache", str(cache)]) == 0

    document = json.loads(output.read_text())
    assert document["generated_by"] == "scripts/generate_vllm_releases.py"
    assert document["command"] == "python scripts/generate_vllm_releases.py"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", document["generated_at"])
    versions = [release["version"] for release in document["releases"]]
    assert versions == ["9.0.0", "9.1.0", "9.10.0"]
    added = document["releases"][1]
    assert added["wheel"] == wheel.name
    assert added["wheel_sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert added["applied_fields"][0] == "max_model_len"
    assert added["cache_config"]["labels"][-1] == {"name": "_block_size_resolved", "default": "True"}


def test_two_cached_wheels_for_one_release_stop_the_run(tmp_path: Path) -> None:
    _fake_wheel(tmp_path, "9.1.0")
    (tmp_path / "vllm-9.1.0-1-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")
    with pytest.raises(ExtractionError, match="several cached wheels"):
        generator.fetch_wheel("9.1.0", tmp_path)


# ---------------------------------------------------------------- the committed table


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(COMMITTED.read_text())


def _release(committed: dict, version: str) -> dict:
    return next(release for release in committed["releases"] if release["version"] == version)


def _fields(release: dict) -> list[str]:
    return [field["name"] for field in release["ready_response"]["fields"]]


def test_committed_table_was_generated_for_every_release(committed: dict) -> None:
    assert committed["generated_by"] == "scripts/generate_vllm_releases.py"
    assert committed["command"] == "python scripts/generate_vllm_releases.py"
    versions = [release["version"] for release in committed["releases"]]
    assert set(SURVEYED_RELEASES) <= set(versions)
    assert versions == sorted(versions, key=generator.version_key)
    for release in committed["releases"]:
        assert re.fullmatch(r"[0-9a-f]{64}", release["wheel_sha256"]), release["version"]
        assert release["wheel"].startswith(f"vllm-{release['version']}-") and release["wheel"].endswith(".whl")


def test_committed_block_size_and_mamba_block_size_arrive_when_vllm_added_them(committed: dict) -> None:
    with_block_size = [release["version"] for release in committed["releases"] if "block_size" in _fields(release)]
    with_mamba = [release["version"] for release in committed["releases"] if "mamba_block_size" in _fields(release)]
    assert with_block_size[0] == "0.23.0"
    assert with_mamba[0] == "0.29.0"
    assert "mamba_block_size" in _release(committed, "0.29.0")["applied_fields"]


def test_committed_newest_labels(committed: dict) -> None:
    newest = _release(committed, "0.34.0")
    labels = {label["name"]: label["default"] for label in newest["cache_config"]["labels"]}
    assert newest["cache_config"]["default_block_size"] == 64
    assert labels["block_size"] == "64"
    assert labels["_block_size_resolved"] == "True"
    assert labels["_extensible_kv_cache_resolved"] == "False"
    assert labels["user_specified_block_size"] == "False"


def test_committed_ready_response_fields_are_only_ever_added(committed: dict) -> None:
    releases = committed["releases"]
    for previous, current in itertools.pairwise(releases):
        assert set(_fields(previous)) <= set(_fields(current)), current["version"]
        order = [name for name in _fields(current) if name in _fields(previous)]
        assert order == _fields(previous), current["version"]
        assert set(current["applied_fields"]) <= set(_fields(current)), current["version"]
