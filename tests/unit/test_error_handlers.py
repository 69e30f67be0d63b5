"""A defect in a route still answers the JSON error body every client parses."""

from __future__ import annotations

import logging

import pytest
from cassandra import ReadFailure
from cassandra.cluster import NoHostAvailable
from fastapi import FastAPI
from fastapi.testclient import TestClient

from producers.gateway.errors import (
    install_error_handlers,
    kafka_unreachable,
    tagged_refusal,
    unknown_model,
)
from producers.gateway.openai_api.protocol import ChatCompletionRequest


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


def test_a_store_unreachable_is_a_503_and_a_log_line_naming_the_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The 503 went unlogged: an operator saw only a status count, whether Cassandra
    was down or one partition failed every read."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/v1/conversations")
    async def conversations() -> None:
        raise ReadFailure("Operation failed - received 0 responses and 1 failures")

    with caplog.at_level(logging.WARNING, logger="producers.gateway.errors"):
        answer = TestClient(app).get("/v1/conversations")
    assert answer.status_code == 503 and "Cassandra" in answer.json()["error"]["message"]
    (logged,) = [r.getMessage() for r in caplog.records]
    assert "GET /v1/conversations" in logged and "ReadFailure" in logged


def test_an_unknown_model_says_so_in_openais_code() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/model")
    async def model() -> None:
        raise unknown_model("gpt-9")

    error = TestClient(app).get("/model").json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_a_body_sent_as_another_content_type_is_told_to_send_json() -> None:
    """`curl -d` sends a form: the 400 said "Input should be a valid dictionary or
    instance of ChatCompletionRequest", naming an internal class, not the header."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def complete(body: ChatCompletionRequest) -> None:
        return None

    client, sent = TestClient(app), b'{"model": "m", "messages": []}'
    # Not JSON to FastAPI, though "json" is in them: they named the class too.
    others = ("text/plain", "application/x-www-form-urlencoded", "text/json", "application/jsonl")
    for content_type in others:
        answer = client.post(
            "/v1/chat/completions", content=sent, headers={"content-type": content_type}
        )
        assert answer.status_code == 400
        message = answer.json()["error"]["message"]
        assert "Content-Type: application/json" in message and content_type in message
    typed = client.post(
        "/v1/chat/completions", content=sent, headers={"content-type": "application/json"}
    )
    assert (
        typed.status_code == 400
        and answer.json()["error"]["message"] != typed.json()["error"]["message"]
    )
    assert typed.json()["error"]["param"] == "messages"


def test_a_method_a_route_does_not_take_is_a_405_that_says_which_it_takes() -> None:
    """The JSON body dropped Starlette's Allow header (RFC 9110 requires it)."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/v1/models")
    async def models() -> None:
        return None

    answer = TestClient(app).delete("/v1/models")
    assert answer.status_code == 405 and answer.json()["error"]["message"]
    assert answer.headers["allow"] == "GET"


@pytest.mark.parametrize(
    "refused",
    [
        kafka_unreachable("the prompt queue is unreachable"),
        NoHostAvailable("Unable to complete the operation against any hosts", {}),
    ],
    ids=["kafka", "cassandra"],
)
def test_a_refusal_once_admitted_carries_the_request_id(refused: Exception) -> None:
    """Refused once admitted (Kafka or Cassandra out of reach): the answer had no
    X-Request-Id, though the gateway had logged the request under one."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def completions() -> None:
        try:
            raise refused
        except Exception as exc:
            raise tagged_refusal(exc, "r_1234") from exc

    answer = TestClient(app, raise_server_exceptions=False).post("/v1/chat/completions")
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["type"] == "service_unavailable"
    assert answer.headers["X-Request-Id"] == "r_1234"
    assert answer.headers["Retry-After"]
