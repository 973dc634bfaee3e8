"""Generate protocol/vllm_releases.json: per-release vLLM facts read from the released wheels.

For each release the wheel is fetched with ``pip download`` (never installed) into a cache outside the
repository, and three source files are read straight from the zip and parsed with ``ast`` (vLLM is never
imported): the ``EngineCoreReadyResponse`` fields, the response attributes ``MPClient._apply_ready_response``
reads, and the ``vllm:cache_config_info`` labels (``CacheConfig.metrics_info()`` keys) with the values a
``CacheConfig()`` built without arguments renders. Anything that cannot be determined statically stops the
run with an ``ExtractionError`` naming the file and line, rather than being guessed.

    python scripts/generate_vllm_releases.py            # every release this tool knows, plus those in the JSON
    python scripts/generate_vllm_releases.py 0.35.0     # add or refresh one release, keep the others
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RELEASES = (
    "0.20.0",
    "0.20.1",
    "0.20.2",
    "0.21.0",
    "0.22.0",
    "0.22.1",
    "0.23.0",
    "0.24.0",
    "0.25.0",
    "0.25.1",
    "0.26.0",
    "0.27.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
    "0.34.0",
)
REPOSITORY = Path(__file__).resolve().parent.parent
OUTPUT = REPOSITORY / "protocol" / "vllm_releases.json"
WHEEL_CACHE = Path.home() / ".cache" / "cache-config-exporter" / "wheels"
COMMAND = "python scripts/generate_vllm_releases.py"

READY_RESPONSE_FILE = "vllm/v1/engine/__init__.py"
CORE_CLIENT_FILE = "vllm/v1/engine/core_client.py"
CACHE_CONFIG_FILE = "vllm/config/cache.py"
VERSION_PATTERN = re.compile(r"\d+(\.\d+)+")


class ExtractionError(Exception):
    """A fact the tool cannot determine statically: the run stops instead of guessing."""


def _fail(path: str, node: ast.AST | None, message: str) -> ExtractionError:
    where = f"{path}:{node.lineno}" if node is not None and hasattr(node, "lineno") else path
    return ExtractionError(f"{where}: {message}")


def _find_class(module: ast.Module, name: str, path: str) -> ast.ClassDef:
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise _fail(path, None, f"no top-level class {name}")


def _methods(cls: ast.ClassDef) -> list[ast.FunctionDef]:
    return [node for node in cls.body if isinstance(node, ast.FunctionDef)]


def _call_to(node: ast.AST | None, *names: str) -> ast.Call | None:
    """``node`` if it calls ``f(...)`` or ``m.f(...)`` for one of ``names``."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return node if called in names else None


def _is_classvar(annotation: ast.expr) -> bool:
    target = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return ast.unparse(target) in ("ClassVar", "typing.ClassVar")


def _annotated_fields(cls: ast.ClassDef, path: str) -> Iterable[tuple[str, ast.AnnAssign]]:
    """``(name, declaration)`` of the class-body annotations that are dataclass fields (not ``ClassVar``)."""
    for statement in cls.body:
        if isinstance(statement, ast.AnnAssign) and not _is_classvar(statement.annotation):
            if not isinstance(statement.target, ast.Name):
                raise _fail(path, statement, f"unexpected field target {ast.unparse(statement.target)}")
            yield statement.target.id, statement


# ---------------------------------------------------------------- EngineCoreReadyResponse


def extract_ready_response(source: str, path: str = READY_RESPONSE_FILE) -> dict[str, Any]:
    """The fields of ``EngineCoreReadyResponse`` in declaration order (the order msgspec encodes them)."""
    cls = _find_class(ast.parse(source), "EngineCoreReadyResponse", path)
    _require_plain_dataclass(cls, path)
    fields = []
    for name, statement in _annotated_fields(cls, path):
        default = _dataclass_default(statement, path)
        fields.append(
            {
                "name": name,
                "annotation": ast.unparse(statement.annotation),
                "required": default is None,
                "default": default,
            }
        )
    return {"source": f"{path}:{cls.lineno}", "fields": fields}


def _require_plain_dataclass(cls: ast.ClassDef, path: str) -> None:
    """A plain ``@dataclass`` is what msgspec encodes as a map keyed by field name, every field present.

    Any other kind (a msgspec.Struct with ``array_like``/``omit_defaults``, a subclass) changes the wire
    format the exporter decodes, so it stops the run.
    """
    decorators = [ast.unparse(decorator) for decorator in cls.decorator_list]
    if decorators not in (["dataclass"], ["dataclasses.dataclass"]) or cls.bases or cls.keywords:
        raise _fail(path, cls, f"{cls.name} is no longer a plain @dataclass (decorators {decorators})")


def _dataclass_default(statement: ast.AnnAssign, path: str) -> str | None:
    """``ast.unparse`` of a dataclass field's default expression, None for a required field."""
    if statement.value is None:
        return None
    call = _call_to(statement.value, "field")
    if call is None:
        return ast.unparse(statement.value)
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    if call.args or set(keywords) - {"default", "default_factory"}:
        raise _fail(path, statement, f"field() options the exporter does not model: {ast.unparse(call)}")
    if "default" in keywords:
        return ast.unparse(keywords["default"])
    if "default_factory" in keywords:
        return f"{ast.unparse(keywords['default_factory'])}()"
    return None


# ---------------------------------------------------------------- MPClient._apply_ready_response


def extract_applied_fields(source: str, path: str = CORE_CLIENT_FILE) -> list[str]:
    """Response attributes ``MPClient._apply_ready_response`` reads, in first-read order."""
    cls = _find_class(ast.parse(source), "MPClient", path)
    method = next((node for node in _methods(cls) if node.name == "_apply_ready_response"), None)
    if method is None:
        raise _fail(path, cls, "MPClient has no _apply_ready_response")
    response_names = _decoded_response_names(method)
    if not response_names:
        raise _fail(path, method, "no decode(..., type=EngineCoreReadyResponse) assigned to a name")
    collector = _ResponseReads(response_names, path)
    for statement in method.body:
        collector.visit(statement)
    return list(dict.fromkeys(collector.reads))


def _decoded_response_names(method: ast.FunctionDef) -> set[str]:
    """Names bound to ``...decode(payload, type=EngineCoreReadyResponse)`` (also inside a conditional)."""
    names = set()
    for node in ast.walk(method):
        if isinstance(node, ast.Assign) and any(_is_response_decode(inner) for inner in ast.walk(node.value)):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def _is_response_decode(node: ast.AST) -> bool:
    call = _call_to(node, "decode")
    return call is not None and any(
        keyword.arg == "type" and ast.unparse(keyword.value) == "EngineCoreReadyResponse" for keyword in call.keywords
    )


class _ResponseReads(ast.NodeVisitor):
    """Collects ``response.x`` and ``getattr(response, "x")`` reads in evaluation order.

    Any other use of the response (passing it on, aliasing it) would hide reads, so it stops the run.
    """

    def __init__(self, response_names: set[str], path: str) -> None:
        self.response_names = response_names
        self.path = path
        self.reads: list[str] = []
        self.loop_strings: dict[str, list[str]] = {}

    def _is_response(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in self.response_names

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)  # the value is evaluated before the targets
        for target in node.targets:
            self.visit(target)

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        if isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Tuple | ast.List):
            strings = [element.value for element in node.iter.elts if isinstance(element, ast.Constant)]
            if len(strings) == len(node.iter.elts) and all(isinstance(string, str) for string in strings):
                self.loop_strings[node.target.id] = strings
        for statement in [*node.body, *node.orelse]:
            self.visit(statement)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self._is_response(node.value):
            self.reads.append(node.attr)
        else:
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if _call_to(node, "getattr") and node.args and self._is_response(node.args[0]):
            self.reads.extend(self._getattr_names(node))
            for argument in node.args[2:]:
                self.visit(argument)
        else:
            self.generic_visit(node)

    def _getattr_names(self, node: ast.Call) -> list[str]:
        name = node.args[1] if len(node.args) > 1 else None
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            return [name.value]
        if isinstance(name, ast.Name) and name.id in self.loop_strings:
            return self.loop_strings[name.id]
        raise _fail(self.path, node, f"response attribute not known statically: {ast.unparse(node)}")

    def visit_Compare(self, node: ast.Compare) -> None:
        """``response is None`` / ``is not None`` reads no attribute."""
        is_none_check = (
            self._is_response(node.left)
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.Is | ast.IsNot)
            and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value is None
        )
        if not is_none_check:
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.response_names and isinstance(node.ctx, ast.Load):
            raise _fail(self.path, node, f"the decoded response escapes the tool's view: {node.id} used as a value")


# ---------------------------------------------------------------- CacheConfig


def extract_cache_config(source: str, path: str = CACHE_CONFIG_FILE) -> dict[str, Any]:
    """``CacheConfig.metrics_info()`` keys with the values ``CacheConfig()`` renders, in ``__dict__`` order.

    CacheConfig is a pydantic dataclass (``@config``, vllm/config/utils.py): every field, ``init=False`` and
    ``_``-prefixed ones included, is in ``__dict__`` in declaration order, and ``metrics_info()`` is
    ``{k: str(v) for k, v in self.__dict__.items()}``.
    """
    module = ast.parse(source)
    cls = _find_class(module, "CacheConfig", path)
    decorators = [ast.unparse(decorator) for decorator in cls.decorator_list]
    if decorators != ["config"] or cls.bases:
        raise _fail(path, cls, f"CacheConfig is no longer a bare @config pydantic dataclass ({decorators})")
    class_vars = _class_vars(cls, path)
    values = {
        name: _field_default(name, statement, class_vars, module, path)
        for name, statement in _annotated_fields(cls, path)
    }
    for hook in _construction_hooks(cls):
        rule = CONSTRUCTION_RULES.get(hook.name)
        if rule is None:
            raise _fail(path, hook, f"construction hook {hook.name} has no rule in this tool")
        rule(hook, values, class_vars, path)
    default_block_size = class_vars.get("DEFAULT_BLOCK_SIZE", values.get("block_size"))
    if not isinstance(default_block_size, int):
        raise _fail(path, cls, f"no integer default block size ({default_block_size!r})")
    return {
        "source": f"{path}:{cls.lineno}",
        "default_block_size": default_block_size,
        "labels": [{"name": name, "default": str(value)} for name, value in values.items()],
    }


def _class_vars(cls: ast.ClassDef, path: str) -> dict[str, Any]:
    """``X: ClassVar[...] = literal`` declarations, which field defaults may refer to."""
    class_vars = {}
    for statement in cls.body:
        if isinstance(statement, ast.AnnAssign) and _is_classvar(statement.annotation) and statement.value:
            class_vars[ast.unparse(statement.target)] = _literal(statement.value, {}, path)
    return class_vars


def _literal(node: ast.expr, class_vars: dict[str, Any], path: str) -> Any:
    """A Python literal, or a reference to a class variable (``DEFAULT_X`` / ``CacheConfig.DEFAULT_X``)."""
    reference = ast.unparse(node).removeprefix("CacheConfig.")
    if reference in class_vars:
        return class_vars[reference]
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise _fail(path, node, f"default not determinable statically: {ast.unparse(node)}") from None


def _field_default(
    name: str, statement: ast.AnnAssign, class_vars: dict[str, Any], module: ast.Module, path: str
) -> Any:
    """The value a field holds right after ``CacheConfig()`` field initialisation, before any validator."""
    if statement.value is None:
        raise _fail(path, statement, f"{name} has no default, so CacheConfig() cannot be built")
    call = _call_to(statement.value, "Field", "field")
    if call is None:
        return _literal(statement.value, class_vars, path)
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    if "validate_default" in keywords:
        # Pydantic runs field validators on a default only with validate_default (off by default).
        raise _fail(path, statement, f"{name} sets validate_default: validators would run on the default")
    if call.args:  # Field(default, ...) given positionally
        return _literal(call.args[0], class_vars, path)
    if "default" in keywords:
        return _literal(keywords["default"], class_vars, path)
    if "default_factory" in keywords:
        factory = ast.unparse(keywords["default_factory"])
        rule = DEFAULT_FACTORY_RULES.get(factory)
        if rule is None:
            raise _fail(path, statement, f"{name}: default_factory {factory} has no rule in this tool")
        return rule(module, path)
    raise _fail(path, statement, f"{name} has no default, so CacheConfig() cannot be built")


# Default-factory rules: factory name -> value it returns for CacheConfig() in a plain deployment.


def empty_list_factory(module: ast.Module, path: str) -> list[Any]:
    """``field(default_factory=list)`` (e.g. ``kv_cache_dtype_skip_layers``): an empty list, label "[]"."""
    return []


def prefix_cache_retention_interval_factory(module: ast.Module, path: str) -> int:
    """vllm/config/cache.py ``_get_prefix_cache_retention_interval`` (0.29.0), the default factory of
    ``prefix_cache_retention_interval``: the deprecated env var VLLM_PREFIX_CACHE_RETENTION_INTERVAL,
    unset in a plain deployment, gives 0. Checked against the function's return statement."""
    function = next(
        (
            node
            for node in module.body
            if isinstance(node, ast.FunctionDef) and node.name == "_get_prefix_cache_retention_interval"
        ),
        None,
    )
    expected = "return 0 if env_value is None else int(env_value)"
    if function is None or ast.unparse(function.body[-1]) != expected:
        raise _fail(path, function, "_get_prefix_cache_retention_interval changed: its default is not known")
    return 0


DEFAULT_FACTORY_RULES: dict[str, Callable[[ast.Module, str], Any]] = {
    "list": empty_list_factory,
    "_get_prefix_cache_retention_interval": prefix_cache_retention_interval_factory,
}


# Construction rules: what the validators and __post_init__ that run inside CacheConfig() change.


def _construction_hooks(cls: ast.ClassDef) -> list[ast.FunctionDef]:
    """Methods that run while ``CacheConfig()`` is built and may change ``__dict__``.

    Field validators are not among them: pydantic does not run them on defaults (no validate_default).
    """
    return [
        method
        for method in _methods(cls)
        if method.name == "__post_init__"
        or any(_call_to(decorator, "model_validator") for decorator in method.decorator_list)
    ]


def _attribute_assignments(method: ast.FunctionDef) -> set[tuple[str, str]]:
    """``(attribute, value source)`` for ``self.a = v`` and ``object.__setattr__(self, "a", v)``."""
    assignments = set()
    for node in ast.walk(method):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                    assignments.add((target.attr, ast.unparse(node.value)))
        elif (call := _call_to(node, "__setattr__")) and len(call.args) == 3:
            _, attribute, value = call.args
            name = attribute.value if isinstance(attribute, ast.Constant) else ast.unparse(attribute)
            assignments.add((str(name), ast.unparse(value)))
    return assignments


BLOCK_SIZE_DEFAULT_ASSIGNMENTS = {
    ("_block_size_resolved", "True"),
    ("block_size", "self.DEFAULT_BLOCK_SIZE"),
    ("user_specified_block_size", "True"),
    ("user_specified_mamba_block_size", "True"),
}


def apply_block_size_default(
    hook: ast.FunctionDef, values: dict[str, Any], class_vars: dict[str, Any], path: str
) -> None:
    """vllm/config/cache.py ``CacheConfig._apply_block_size_default``, ``@model_validator(mode="after")``
    (0.18.0+): sets ``_block_size_resolved`` True, replaces a None ``block_size`` by ``DEFAULT_BLOCK_SIZE``,
    and sets ``user_specified_block_size`` / ``user_specified_mamba_block_size`` only when
    ``block_size`` / ``mamba_block_size`` were passed, which ``CacheConfig()`` does not do."""
    unknown = _attribute_assignments(hook) - BLOCK_SIZE_DEFAULT_ASSIGNMENTS
    if unknown:
        raise _fail(path, hook, f"_apply_block_size_default now also assigns {sorted(unknown)}")
    if values.get("mamba_block_size") is not None:
        raise _fail(path, hook, "mamba_block_size has a non-None default: user_specified_mamba_block_size unknown")
    values["_block_size_resolved"] = True
    if "block_size" in values and values["block_size"] is None:
        values["block_size"] = class_vars["DEFAULT_BLOCK_SIZE"]


CONSTRUCTION_RULES: dict[str, Callable[[ast.FunctionDef, dict[str, Any], dict[str, Any], str], None]] = {
    "_apply_block_size_default": apply_block_size_default,
}


# ---------------------------------------------------------------- wheels and the JSON file


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def fetch_wheel(version: str, cache: Path) -> Path:
    """The release's wheel from the cache (keyed by file name), downloaded with pip when absent."""
    cached = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if len(cached) > 1:
        raise ExtractionError(f"several cached wheels for {version}: {[path.name for path in cached]}")
    if cached:
        return cached[0]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as staging:
        command = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:"]
        subprocess.run([*command, "--quiet", "-d", staging], check=True)
        downloaded = list(Path(staging).glob("*.whl"))
        if len(downloaded) != 1:
            raise ExtractionError(f"pip download of vllm=={version} gave {[path.name for path in downloaded]}")
        return downloaded[0].replace(cache / downloaded[0].name)


def release_facts(version: str, wheel: Path) -> dict[str, Any]:
    """One release's entry of the JSON file, read from its wheel."""
    with zipfile.ZipFile(wheel) as archive:

        def source(path: str) -> str:
            return archive.read(path).decode("utf-8")

        ready_response = extract_ready_response(source(READY_RESPONSE_FILE))
        applied_fields = extract_applied_fields(source(CORE_CLIENT_FILE))
        cache_config = extract_cache_config(source(CACHE_CONFIG_FILE))
    with wheel.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    return {
        "version": version,
        "wheel": wheel.name,
        "wheel_sha256": digest,
        "ready_response": ready_response,
        "applied_fields": applied_fields,
        "cache_config": cache_config,
    }


def generate(versions: Sequence[str], output: Path, cache: Path) -> list[str]:
    """Refresh ``versions`` in ``output``, keeping the releases already there; returns the versions written.

    With no versions, every release in RELEASES and in the existing file is refreshed.
    """
    existing = json.loads(output.read_text())["releases"] if output.exists() else []
    releases = {release["version"]: release for release in existing}
    for version in versions or sorted({*RELEASES, *releases}, key=version_key):
        print(f"vllm {version}", file=sys.stderr)
        releases[version] = release_facts(version, fetch_wheel(version, cache))
    document = {
        "generated_by": "scripts/generate_vllm_releases.py",
        "command": COMMAND,
        "generated_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "releases": [releases[version] for version in sorted(releases, key=version_key)],
    }
    output.write_text(json.dumps(document, indent=2) + "\n")
    return [release["version"] for release in document["releases"]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="*", help="releases to add or refresh (default: all)")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default {OUTPUT}")
    parser.add_argument("--wheel-cache", type=Path, default=WHEEL_CACHE, help=f"default {WHEEL_CACHE}")
    arguments = parser.parse_args(argv)
    for version in arguments.versions:
        if not VERSION_PATTERN.fullmatch(version):
            parser.error(f"not a release version: {version}")
    try:
        written = generate(arguments.versions, arguments.output, arguments.wheel_cache)
    except (ExtractionError, subprocess.CalledProcessError) as error:
        print(f"error: {error}\n{arguments.output} left unchanged", file=sys.stderr)
        return 1
    print(f"{arguments.output}: {len(written)} releases, {written[0]} .. {written[-1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
