"""The names and ranges of the exporter's HTTP API, in one home for the server that checks them and for the
plugin and the probe that make names fit them.

A deployment is one or more ``/``-separated segments (served model names like ``org/model``); a replica is
one segment. A segment is letters, digits and ``_.:@+-``, starting with a letter, digit or ``_``.
"""

from __future__ import annotations

import os
import re

DEFAULT_DEPLOYMENT = "default"
DEFAULT_REPLICA = "default"
MAX_NAME_LENGTH = 200
# From a second to a day: a sender that promises heartbeats expires after missing several.
MIN_HEARTBEAT_SECONDS = 1.0
MAX_HEARTBEAT_SECONDS = 86400.0

_FIRST = "A-Za-z0-9_"
_REST = "A-Za-z0-9_.:@+-"
_SEGMENT = f"[{_FIRST}][{_REST}]*"
DEPLOYMENT_NAME = re.compile(rf"{_SEGMENT}(/{_SEGMENT})*")
# The replica's rule as one anchored pattern with its length in it (a msgspec ``Meta`` pattern).
REPLICA_PATTERN = rf"^[{_FIRST}][{_REST}]{{0,{MAX_NAME_LENGTH - 1}}}\Z"
DEPLOYMENT_RULE = (
    f"a deployment name has 1 to {MAX_NAME_LENGTH} characters: letters, digits and _.:@+- "
    "in /-separated segments, none of them 'engines'"
)
_NOT_FIRST = re.compile(f"[^{_FIRST}]")
_NOT_REST = re.compile(f"[^{_REST}]")
# A served model name given as a path: the deployment is named after its last component.
_PATH_PREFIXES = ("/", "./", "../", "~")


def is_deployment_name(name: str) -> bool:
    """Whether ``name`` passes the rule (``engines`` is no segment: it would shadow the engines' routes)."""
    return (
        len(name) <= MAX_NAME_LENGTH
        and DEPLOYMENT_NAME.fullmatch(name) is not None
        and "/engines/" not in (f"/{name}/")
    )


def _fit_segment(segment: str) -> str:
    return _NOT_FIRST.sub("_", segment[0]) + _NOT_REST.sub("_", segment[1:])


def fit_deployment_name(name: str) -> str:
    """``name`` made to fit the rule: every character it does not allow becomes ``_``."""
    fitted = "/".join(_fit_segment(segment) for segment in name.split("/") if segment)
    return fitted[:MAX_NAME_LENGTH].rstrip("/") or DEFAULT_DEPLOYMENT


def fit_replica_name(name: str) -> str:
    """``name`` made to fit the replica's rule (one segment: ``/`` too becomes ``_``)."""
    return _fit_segment(name)[:MAX_NAME_LENGTH] if name else DEFAULT_REPLICA


def deployment_of_model(name: str) -> str:
    """A served model name as a deployment: a path by its last component, fit to the rule.

    The plugin reads the name from vLLM's config, the probe from vLLM's ``model_name`` label: both name a
    server alike.
    """
    if name.startswith(_PATH_PREFIXES):
        name = os.path.basename(os.path.normpath(os.path.abspath(os.path.expanduser(name))))
    return fit_deployment_name(name)
