"""Static labels: the frontend's ``metrics_info()`` as the plugin sends it, or a person's part of it."""

from __future__ import annotations

import msgspec
import pytest

from protocol import InvalidPayload, decode_static_labels


def test_strings_pass_through_exactly_as_vllm_rendered_them() -> None:
    sent = b'{"block_size": "16", "prefix_cache_retention_interval": "None", "kv_cache_dtype_skip_layers": "[]"}'
    assert decode_static_labels(sent) == {
        "block_size": "16",
        "prefix_cache_retention_interval": "None",
        "kv_cache_dtype_skip_layers": "[]",
    }


def test_other_values_render_like_python_str_of_the_same_value() -> None:
    document = b'{"enable_prefix_caching": true, "sliding_window": null, "gpu_memory_utilization": 0.9, "x": ["a"]}'
    assert decode_static_labels(document) == {
        "enable_prefix_caching": "True",
        "sliding_window": "None",
        "gpu_memory_utilization": "0.9",
        "x": "['a']",
    }


@pytest.mark.parametrize("document_format", ["json", "toml", "yaml"])
def test_every_document_format_gives_the_same_labels(document_format: str) -> None:
    document = {
        "json": b'{"mamba_cache_mode": "align", "gpu_memory_utilization": 0.9}',
        "toml": b'mamba_cache_mode = "align"\ngpu_memory_utilization = 0.9\n',
        "yaml": b"mamba_cache_mode: align\ngpu_memory_utilization: 0.9\n",
    }[document_format]
    assert decode_static_labels(document, document_format) == {
        "mamba_cache_mode": "align",
        "gpu_memory_utilization": "0.9",
    }


@pytest.mark.parametrize(
    ("document", "field", "malformed"),
    [
        (b'{"__name__": "x"}', "$.__name__", False),
        (b'{"engine": "3"}', "$.engine", False),
        (b'{"deployment": "x"}', "$.deployment", False),
        (b'{"9lives": "x"}', "$.9lives", False),
        (b'{"block-size": "16"}', "$.block-size", False),
        (b'{"a": "' + b"x" * 5000 + b'"}', "$.a", False),
        (b"[1, 2]", "$", False),
        (b"", "$", True),
        (b'{"a": ', "$", True),
    ],
)
def test_bad_documents_name_the_label_at_fault(document: bytes, field: str, malformed: bool) -> None:
    with pytest.raises(InvalidPayload) as refused:
        decode_static_labels(document)
    assert (refused.value.field, refused.value.malformed) == (field, malformed)


def test_too_many_labels_are_refused() -> None:
    document = "{" + ",".join(f'"l{index}": "v"' for index in range(129)) + "}"
    with pytest.raises(InvalidPayload, match="129 labels"):
        decode_static_labels(document.encode())


@pytest.mark.parametrize("name", ["evil\n", "block_size\n", "engine\n", "deployment\n", "a\nb", "\n", "a\r", "a "])
def test_a_name_with_a_line_break_or_space_anywhere_is_refused(name: str) -> None:
    """A pattern ending in ``$`` would let a trailing newline through, and that newline ends the exposition line."""
    with pytest.raises(InvalidPayload) as refused:
        decode_static_labels(msgspec.json.encode({name: "x"}))
    assert refused.value.field == f"$.{name}"


def test_a_name_of_exactly_128_characters_is_accepted_and_129_refused() -> None:
    assert decode_static_labels(msgspec.json.encode({"a" * 128: "x"})) == {"a" * 128: "x"}
    with pytest.raises(InvalidPayload):
        decode_static_labels(msgspec.json.encode({"a" * 129: "x"}))


def test_exactly_128_labels_are_accepted() -> None:
    document = {f"l{index}": "v" for index in range(128)}
    assert decode_static_labels(msgspec.json.encode(document)) == document
