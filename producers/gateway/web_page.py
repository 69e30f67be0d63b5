"""The chat page: plain files under web/, no build step, served with a strict
Content-Security-Policy (scripts and connections to this origin only)."""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

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


class _PageFiles(StaticFiles):
    def file_response(
        self,
        full_path: str | os.PathLike[str],
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(HEADERS)
        return response


def install_page(app: FastAPI) -> None:
    """`/` is the page; `/web/*` its scripts and styles. They hold no data, so they
    need no key: every API route they call does."""

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", headers=HEADERS)

    app.mount("/web", _PageFiles(directory=WEB_DIR), name="web")
