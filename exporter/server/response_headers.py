"""ASGI middleware adding the web config's ``http_server_config.headers`` (as the file is now) to every answer:
``exporter/security/web_config.py`` reads and checks them, this serves them."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exporter.flags.watched_files import Watched
from exporter.security.web_config import WebConfig, response_headers


class ResponseHeaders:
    """ASGI middleware adding ``http_server_config.headers`` of the web config (as it is now) to every response."""

    def __init__(self, app: ASGIApp, web_config: Watched[WebConfig] | None) -> None:
        self.app = app
        self.web_config = web_config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        web_config = self.web_config
        if scope["type"] != "http" or web_config is None:
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = response_headers(web_config)
                if extra:
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
