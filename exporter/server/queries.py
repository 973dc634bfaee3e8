"""What the routes take: the media types, the names and ranges of their parameters, and the msgspec Structs
of their queries (the schema of each, also the source of the OpenAPI document), parsed into 422s that name
the parameter at fault."""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Any, TypeVar

import msgspec
from starlette.requests import Request

from exporter.errors import InvalidRequest, UnsupportedMediaType
from exporter.exposition.shards import MAX_SHARDS, Shard
from exporter.probe.allowlist import MAX_TARGET
from protocol import (
    InvalidPayload,
)
from protocol.names import (
    DEFAULT_REPLICA,
    DEPLOYMENT_NAME,
    DEPLOYMENT_RULE,
    MAX_HEARTBEAT_SECONDS,
    MAX_NAME_LENGTH,
    MIN_HEARTBEAT_SECONDS,
    REPLICA_PATTERN,
    is_deployment_name,
)
from protocol.ready_response import JSON, MAX_PARALLEL, MSGPACK

READY_MEDIA_TYPES = {
    "application/vnd.msgpack": MSGPACK,
    "application/msgpack": MSGPACK,
    "application/x-msgpack": MSGPACK,
    "application/json": JSON,
}
LABELS_MEDIA_TYPES = {"application/json": JSON}
MAX_PAGE = 1000
# Most ready responses in one request (an array of one replica's engines): the answer names each refused one.
MAX_READY_BATCH = 1024
# The first byte of a msgpack array (fixarray, array 16, array 32); a JSON array starts with ``[``.
MSGPACK_ARRAY = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
item_decoders = {
    MSGPACK: msgspec.msgpack.Decoder(list[msgspec.Raw]),
    JSON: msgspec.json.Decoder(list[msgspec.Raw]),
}

ReplicaName = Annotated[
    str,
    msgspec.Meta(
        pattern=REPLICA_PATTERN,
        description="The vLLM server of the deployment (host:port, pod name, ...).",
    ),
]
Heartbeat = Annotated[
    float,
    msgspec.Meta(
        ge=MIN_HEARTBEAT_SECONDS,
        le=MAX_HEARTBEAT_SECONDS,
        description="Seconds between the heartbeats the sender promises.",
    ),
]
EngineIndex = Annotated[
    int, msgspec.Meta(ge=0, lt=MAX_PARALLEL, description="Engine index for payloads without a rank.")
]
After = Annotated[
    str,
    msgspec.Meta(
        max_length=2 * MAX_NAME_LENGTH + 1,
        description="Start after this deployment (all its replicas), or after 'DEPLOYMENT REPLICA'.",
    ),
]
PageSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGE, description="Most replicas to return.")]
DeploymentName = Annotated[
    str, msgspec.Meta(max_length=MAX_NAME_LENGTH, description="Only the replicas of this deployment.")
]


class ReadyQuery(msgspec.Struct, frozen=True):
    engine: EngineIndex | None = None
    replica: ReplicaName = DEFAULT_REPLICA
    heartbeat: Heartbeat | None = None


class LabelsQuery(msgspec.Struct, frozen=True):
    replica: ReplicaName = DEFAULT_REPLICA
    heartbeat: Heartbeat | None = None


class HeartbeatQuery(msgspec.Struct, frozen=True):
    interval: Annotated[
        float,
        msgspec.Meta(
            ge=MIN_HEARTBEAT_SECONDS, le=MAX_HEARTBEAT_SECONDS, description="Seconds until the next heartbeat."
        ),
    ]
    replica: ReplicaName = DEFAULT_REPLICA


class ReplicaQuery(msgspec.Struct, frozen=True):
    replica: ReplicaName = DEFAULT_REPLICA


class GoodbyeQuery(msgspec.Struct, frozen=True):
    """Without ``replica``, the whole deployment."""

    replica: ReplicaName | None = None


class ListQuery(msgspec.Struct, frozen=True):
    after: After | None = None
    limit: PageSize | None = None
    deployment: DeploymentName | None = None


class EnginePath(msgspec.Struct, frozen=True):
    engine: int


class ProbeQuery(msgspec.Struct, frozen=True):
    target: Annotated[
        str,
        msgspec.Meta(
            max_length=MAX_TARGET,
            description="The vLLM server to probe, HOST:PORT; --probe.allowed-targets must permit it.",
        ),
    ]
    deployment: (
        Annotated[
            str,
            msgspec.Meta(
                pattern=rf"^{DEPLOYMENT_NAME.pattern}\Z",
                max_length=MAX_NAME_LENGTH,
                description="The deployment label; default: the model_name vLLM shows.",
            ),
        ]
        | None
    ) = None
    debug: Annotated[bool, msgspec.Meta(description="Answer the probe's log and its metrics as plain text.")] = False


class MetricsQuery(msgspec.Struct, frozen=True):
    """A shard of the exposition (``exporter/exposition/shards.py``): both or neither."""

    shard: (
        Annotated[int, msgspec.Meta(ge=0, lt=MAX_SHARDS, description="This scrape's shard: 0 to total_shards - 1.")]
        | None
    ) = None
    total_shards: (
        Annotated[int, msgspec.Meta(ge=1, le=MAX_SHARDS, description="Shards the deployments are split into.")] | None
    ) = None

    def selected(self) -> Shard | None:
        """The shard asked for, ``None`` for the whole; a 422 naming the parameter when one comes alone or the
        shard is not below the total."""
        if self.shard is None and self.total_shards is None:
            return None
        if self.shard is None:
            raise InvalidRequest("query.shard", "total_shards needs shard: the shard of this scrape")
        if self.total_shards is None:
            raise InvalidRequest("query.total_shards", "shard needs total_shards: how many shards there are")
        if self.shard >= self.total_shards:
            raise InvalidRequest("query.shard", f"{self.shard} is not below total_shards, {self.total_shards}")
        return Shard(self.shard, self.total_shards)


Q = TypeVar("Q", bound=msgspec.Struct)


def parsed(values: dict[str, Any], kind: type[Q], location: str) -> Q:
    """Query or path parameters as their Struct; a value out of its schema is a 422 naming it."""
    try:
        return msgspec.convert(values, kind, strict=False)
    except msgspec.ValidationError as error:
        invalid = InvalidPayload.from_msgspec(error)
        raise InvalidRequest(f"{location}.{invalid.field.removeprefix('$.')}", invalid.reason) from None


def parse_query(request: Request, kind: type[Q]) -> Q:
    """The query string's parameters as ``kind`` (the last of a repeated one, as Starlette's ``query_params``), parsed
    without building Starlette's multi-dict: a heartbeat, a fleet's most frequent request, is mostly this."""
    pairs = urllib.parse.parse_qsl(request.scope["query_string"].decode("latin-1"), keep_blank_values=True)
    return parsed(dict(pairs), kind, "query")


def deployment_of(request: Request) -> str:
    name: str = request.path_params.get("deployment", "default")
    if not is_deployment_name(name):
        raise InvalidRequest("deployment", DEPLOYMENT_RULE)
    return name


def wire_format_of(request: Request, accepted: dict[str, str]) -> str:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in accepted:
        detail = f"Content-Type {media_type or '(none)'!r} is not one of {', '.join(accepted)}"
        raise UnsupportedMediaType("Content-Type", detail)
    return accepted[media_type]
