"""The gateway's middleware, installed in one call: request limits, the key of an upload
checked before its body, and CORS only for the origins listed in `cors_origins` (none
by default: no cross-origin access)."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from producers.gateway.auth import KeyBeforeBody
from producers.gateway.limits import RequestLimits
from tandoor.settings import Settings

CORS_METHODS = ["GET", "POST", "PATCH", "DELETE"]
CORS_HEADERS = ["Authorization", "Content-Type", "Last-Event-ID"]
CORS_EXPOSED = ["X-Request-Id", "Retry-After"]

MULTIPART_ROOM = 64 * 1024  # the form around an uploaded file: boundaries, part headers


UPLOADS = "/v1/files"


def install_middleware(app: FastAPI, settings: Settings) -> None:
    app.add_middleware(KeyBeforeBody, paths=[UPLOADS])  # inside the limits: after them
    app.add_middleware(
        RequestLimits,
        max_body_bytes=settings.gateway_max_body_bytes,
        max_headers=settings.gateway_max_headers,
        # The file's own size is checked by its route; the body also holds the form.
        larger_bodies={UPLOADS: settings.gateway_max_file_bytes + MULTIPART_ROOM},
    )
    if settings.cors_origins:
        # Added last, so it runs first: a listed origin's page can read a 413 too.
        # Keys travel in the Authorization header, never in cookies: no credentials mode.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=CORS_METHODS,
            allow_headers=CORS_HEADERS,
            expose_headers=CORS_EXPOSED,
        )
