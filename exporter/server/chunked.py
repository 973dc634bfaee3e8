"""A response of several chunks under one ``Content-Length``, for the large cached parts of the exposition and
the JSON state."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class ChunkedBody(Response):
    """A response sent as several chunks with one ``Content-Length``: large cached parts are never copied, and
    chunks joined as they are sent (``length`` given) are never all held at once."""

    def __init__(
        self, chunks: Iterable[bytes], media_type: str, headers: dict[str, str], length: int | None = None
    ) -> None:
        super().__init__(b"", media_type=media_type, headers=headers)
        if length is None:
            chunks = tuple(chunks)
            length = sum(map(len, chunks))
        self.chunks = chunks
        self.headers["content-length"] = str(length)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        chunks = iter(self.chunks)
        chunk = next(chunks, b"")
        for following in chunks:  # the last chunk ends the body: no empty message after it
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            chunk = following
        await send({"type": "http.response.body", "body": chunk, "more_body": False})
