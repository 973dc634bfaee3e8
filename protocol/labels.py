"""A deployment's static labels: the frontend's ``CacheConfig.metrics_info()``, or a person's part of it.

vLLM renders each ``CacheConfig`` value with Python ``str()`` (``None`` ->
"None", ``True`` -> "True", ``[]`` -> "[]"). The plugin sends those strings as
they are; a person may write JSON, TOML or YAML values instead, and they are
rendered the way vLLM would render the same Python value.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from protocol.errors import InvalidPayload, MalformedPayload

MAX_LABELS = 128
MAX_LABEL_VALUE = 4096
# A Prometheus label name that is not reserved (``__``) and not one the exporter adds itself. Matched whole
# (``fullmatch``): a ``$`` would match before a trailing newline, and that newline would end the exposition line.
_LABEL_NAME = re.compile(r"(?!__)(?!(?:deployment|engine|replica)\Z)[a-zA-Z_][a-zA-Z0-9_]{0,127}")

# Label values as a person may write them; strings pass through unchanged.
_Value = str | int | float | bool | None | list[Any] | dict[str, Any]

_decoders: dict[str, Any] = {
    "json": msgspec.json.Decoder(dict[str, _Value]).decode,
    "toml": lambda data: msgspec.toml.decode(data, type=dict[str, _Value]),
    "yaml": lambda data: msgspec.yaml.decode(data, type=dict[str, _Value]),
}


# The labels whose values the sync reads, and what vLLM can render for them.
_SYNC_INPUTS = {
    "block_size": (re.compile(r"[1-9][0-9]{0,9}"), "a positive whole number"),
    "mamba_block_size": (re.compile(r"None|[1-9][0-9]{0,9}"), "None or a positive whole number"),
    "mamba_cache_mode": (re.compile(r"none|align|all"), "one of none, align, all"),
    "enable_prefix_caching": (re.compile(r"True|False"), "True or False"),
}


def check_labels(labels: dict[str, str], at: str = "$") -> dict[str, str]:
    """Refuse a label map Prometheus or the exporter cannot take, naming the label at fault (under ``at``).

    The one check of every label map an input brings (a person's static labels, a ready response's own
    ``cache_config_info``, a probed target's labels): whatever passes it can be shown in a valid exposition.
    """
    if len(labels) > MAX_LABELS:
        raise InvalidPayload(at, f"{len(labels)} labels, more than the {MAX_LABELS} allowed")
    for name, value in labels.items():
        if not _LABEL_NAME.fullmatch(name):
            raise InvalidPayload(
                f"{at}.{name}",
                "not a label name the exporter can show (letters, digits and _, not starting with a digit or __, "
                "at most 128 characters, not deployment, engine or replica)",
            )
        if len(value) > MAX_LABEL_VALUE:
            raise InvalidPayload(f"{at}.{name}", f"longer than {MAX_LABEL_VALUE} characters")
        if name in _SYNC_INPUTS and not _SYNC_INPUTS[name][0].fullmatch(value):
            raise InvalidPayload(f"{at}.{name}", f"{value[:64]!r} is not {_SYNC_INPUTS[name][1]}")
    return labels


def decode_static_labels(data: bytes, document_format: str = "json") -> dict[str, str]:
    """Labels from a JSON, TOML or YAML object; names are checked, values rendered as vLLM renders them."""
    if not data.strip():
        raise MalformedPayload("$", "the body is empty: expected an object of labels")
    try:
        document = _decoders[document_format](data)
    except msgspec.DecodeError as error:
        raise InvalidPayload.from_msgspec(error) from None
    except RecursionError:
        raise MalformedPayload("$", "nested too deeply") from None
    # str() of the Python value vLLM would hold: JSON ``true`` is ``True``, ``[]`` is ``[]``.
    return check_labels({name: str(value) for name, value in document.items()})


def parse_int(value: str | None) -> int | None:
    """A label value that vLLM rendered from an ``int | None`` field, back as a number."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None
