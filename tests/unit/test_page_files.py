"""The chat page's files, on a small app with the gateway's page routes and error
handlers: a Range header, malformed or past the file's end, was answered by Starlette
in text/plain (a 400 "Malformed range header.", an empty 416), where every other error
of the gateway is JSON. The files are small: they are always sent whole."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from producers.gateway.errors import install_error_handlers
from producers.gateway.web_page import WEB_DIR, install_page


@pytest.fixture
def page() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    install_page(app)
    return TestClient(app)


@pytest.mark.parametrize("path", ["/", "/web/app.js"])
@pytest.mark.parametrize(
    "asked", ["bytes=abc", "items=0-1", "bytes=5-1", "bytes=99999999-", "bytes=0-9"]
)
def test_a_page_file_is_sent_whole_whatever_range_is_asked(
    page: TestClient, path: str, asked: str
) -> None:
    answer = page.get(path, headers={"Range": asked})
    whole = (WEB_DIR / ("index.html" if path == "/" else "app.js")).read_bytes()
    assert answer.status_code == 200, answer.text
    assert answer.content == whole
    assert "accept-ranges" not in answer.headers
    assert answer.headers["content-security-policy"].startswith("default-src 'self'")
