"""HTTP conventions every response of the router's API follows: request ids and CORS.

- ``X-Request-Id``: an incoming one (printable ASCII, at most ``MAX_REQUEST_ID`` characters, no ``~``) is the
  request's id (completions answer ``cmpl-<it>``, chat ``chatcmpl-<it>``) and is echoed on the response;
  without one a fresh id is made and sent. Every response carries the header, errors and streams included.
- CORS (``--allowed-origins``: ``*`` or a comma-separated list of origins; empty = no CORS headers): a request
  from an allowed ``Origin`` gets ``Access-Control-Allow-Origin``; a preflight ``OPTIONS`` from one is answered
  204 with the allowed methods and headers, before authentication (browsers send preflights without keys).
"""
from __future__ import annotations

import uuid

from aiohttp import web

MAX_REQUEST_ID = 128
REQUEST_ID = web.RequestKey("request_id", str)   # the request's id, set on every request by the middleware
ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type, X-Request-Id"


def valid_request_id(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable() and "~" not in value \
        and " " not in value


class Conventions:
    def __init__(self, allowed_origins: str = "") -> None:
        origins = {o.strip() for o in allowed_origins.split(",") if o.strip()}
        self.any_origin, self.origins = "*" in origins, origins - {"*"}

    def allows(self, origin: str | None) -> bool:
        return bool(origin) and (self.any_origin or origin in self.origins)

    def install(self, app: web.Application) -> None:
        app.middlewares.append(self.middleware)
        app.on_response_prepare.append(self.on_prepare)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        incoming = request.headers.get("X-Request-Id", "")
        request[REQUEST_ID] = incoming if valid_request_id(incoming) else uuid.uuid4().hex
        if request.method == "OPTIONS" and self.allows(request.headers.get("Origin")):
            return web.Response(status=204, headers={"Access-Control-Allow-Methods": ALLOW_METHODS,
                                                     "Access-Control-Allow-Headers": ALLOW_HEADERS,
                                                     "Access-Control-Max-Age": "600"})
        return await handler(request)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Request-Id"] = request.get(REQUEST_ID, "")
        origin = request.headers.get("Origin")
        if self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = "*" if self.any_origin else origin
            if not self.any_origin:
                response.headers["Vary"] = "Origin"
