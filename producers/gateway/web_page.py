"""The chat page: plain files under web/, no build step, served with a strict
Content-Security-Policy (scripts and connections to this origin only)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.staticfiles import NotModifiedResponse, StaticFiles
from starlette.types import Receive, Scope, Send

WEB_DIR = Path(__file__).with_name("web")
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; "
        "base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # small files; a new version shows on reload
}


class _WholeFile(FileResponse):
    """Always the whole file (the page's files are small): a Range header, malformed or
    past the end, was Starlette's text/plain 400 or 416, where every error is JSON."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        del self.headers["accept-ranges"]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(name, value) for name, value in scope["headers"] if name != b"range"]
        await super().__call__({**scope, "headers": headers}, receive, send)


class _PageFiles(StaticFiles):
    def file_response(
        self,
        full_path: str | os.PathLike[str],
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = _WholeFile(full_path, status_code, HEADERS, stat_result=stat_result)
        if self.is_not_modified(response.headers, Headers(scope=scope)):
            return NotModifiedResponse(response.headers)
        return response


def install_page(app: FastAPI) -> None:
    """`/` is the page; `/web/*` its scripts and styles. They hold no data, so they
    need no key: every API route they call does."""

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return _WholeFile(WEB_DIR / "index.html", headers=HEADERS)

    app.mount("/web", _PageFiles(directory=WEB_DIR), name="web")
