"""A defect in a route still answers the JSON error body every client parses."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from producers.gateway.errors import install_error_handlers, unknown_model


def test_an_unexpected_exception_is_a_json_500() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/broken")
    async def broken() -> None:
        raise RecursionError("maximum recursion depth exceeded")

    answer = TestClient(app, raise_server_exceptions=False).get("/broken")
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["type"] == "api_error" and "RecursionError" in error["message"]


def test_an_unknown_model_says_so_in_openais_code() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/model")
    async def model() -> None:
        raise unknown_model("gpt-9")

    error = TestClient(app).get("/model").json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
