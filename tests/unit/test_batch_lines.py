"""Batch-input lines from `batch.requests`: parsed with the OpenAI request model, and a
line that is not even JSON still names what is wrong; results in OpenAI's output form."""

from __future__ import annotations

import logging
from typing import cast

import orjson
import pytest

from producers.admission.lines import BatchInputLine, Refused, parse_line, prompt_for
from producers.gateway.chat.checks import ReplyChecks
from schemas.batch import custom_line_request_id, final_output, refused_output
from schemas.events import TOO_LONG_FOR_ENGINE, FinalEvent, Usage
from tandoor.policies.api_keys import Principal
from tandoor.policies.moderation import DefaultModerator
from tandoor.policies.quota import Quotas
from tandoor.settings import Settings, TierPolicy


def line(**changes: object) -> bytes:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    data: dict[str, object] = {
        "custom_id": "q-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": body,
    }
    data.update(changes)
    return orjson.dumps(data)


def test_a_good_line_parses() -> None:
    parsed = parse_line(line())
    assert parsed.problem is None and parsed.line is not None
    assert parsed.custom_id == "q-1" and parsed.line.body.model == "smollm2"


STREAMED = {"stream_options": {"include_usage": True}}  # a batch line cannot stream
# Nested past what orjson writes (255 levels; it reads 1,024): its refusal, quoting the
# value, raised a TypeError, which stopped admission at this line after every restart.
DEEP_TOOLS = line()[:-2] + b',"tools":' + b"[" * 300 + b"]" * 300 + b"}}"


@pytest.mark.parametrize(
    ("raw", "custom_id", "says"),
    [
        (b"{not json", None, "not JSON"),
        (b"", None, "not JSON"),
        (b"[1, 2]", None, "line"),
        ("\udcff".encode("utf-8", "surrogatepass"), None, "not JSON"),
        (line(url="/v1/embeddings"), "q-1", "url"),
        (line(method="GET"), "q-1", "method"),
        (line(custom_id=""), None, "custom_id"),
        (line(custom_id="x" * 513), "x" * 512, "custom_id"),
        (line(body={"model": "smollm2", "messages": []}), "q-1", "body.messages"),
        (
            line(body={"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}),
            "q-1",
            "body.n",
        ),
        (line(extra=1), "q-1", "extra"),
        (DEEP_TOOLS, "q-1", "body.tools"),
        (
            line(body={"model": "m", "messages": [{"role": "user", "content": "x"}]} | STREAMED),
            "q-1",
            "body.stream_options",
        ),
    ],
)
def test_a_bad_line_names_its_problem(raw: bytes, custom_id: str | None, says: str) -> None:
    parsed = parse_line(raw)
    assert parsed.line is None and parsed.problem is not None
    assert parsed.problem.status == 400
    assert says in parsed.problem.message
    assert parsed.problem.kind == "invalid_request_error", "OpenAI's type, as over HTTP"
    assert parsed.custom_id == (custom_id if custom_id else None)


def test_a_line_that_meets_a_defect_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any error but a validation error went up through admission, which stopped at the
    line, and again after every restart: one line held every batch behind it."""

    def defect(data: object) -> BatchInputLine:
        raise TypeError("a validator's defect")

    monkeypatch.setattr(BatchInputLine, "model_validate", defect)
    parsed = parse_line(line())
    assert parsed.line is None and parsed.custom_id == "q-1"
    assert parsed.problem is not None and parsed.problem.status == 500
    assert parsed.problem.kind == "api_error"


def test_a_lines_request_id_is_stable_and_per_owner() -> None:
    one = custom_line_request_id("alice", "b1", "q-1")
    assert one == custom_line_request_id("alice", "b1", "q-1")
    assert one != custom_line_request_id("bob", "b1", "q-1")
    assert one != custom_line_request_id("alice", "b2", "q-1")


def final(reason: str = "stop") -> FinalEvent:
    usage = Usage(prompt_tokens=5, completion_tokens=3, queue_ms=0, decode_ms=0, cached_tokens=2)
    return FinalEvent(
        request_id="bl_1",
        attempt=1,
        seq=1,
        finish_reason=reason,  # type: ignore[arg-type]
        text="raw",
        usage=usage,
        model="smollm2",
        user_id="alice",
        tier="batch",
        conversation_id="bl_1",
        kind="batch",
        created_at_ms=1_700_000_000_000,
        batch_id="b1",
        custom_id="q-1",
    )


def test_an_answer_is_a_chat_completion_with_the_stored_text() -> None:
    out = final_output(final(), "redacted")
    assert out["custom_id"] == "q-1" and out["error"] is None
    response = out["response"]
    assert response["status_code"] == 200
    body = response["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "redacted"
    assert body["usage"]["total_tokens"] == 8
    assert final_output(final(), "redacted") == out  # a replay publishes the same line


@pytest.mark.parametrize(
    ("reason", "code"), [("expired", "batch_expired"), ("cancelled", "cancelled")]
)
def test_a_line_that_ended_without_an_answer_has_an_error(reason: str, code: str) -> None:
    out = final_output(final(reason), "")
    assert out["response"] is None and out["error"]["code"] == code


def test_a_line_cancelled_before_it_started_says_so() -> None:
    never_started = final("cancelled").model_copy(
        update={"usage": Usage(prompt_tokens=0, completion_tokens=0, queue_ms=0, decode_ms=0)}
    )
    assert final_output(never_started, "")["error"]["code"] == "batch_cancelled"


def test_a_line_the_model_failed_has_openais_whole_error_body() -> None:
    """It lacked `param` and `code`, which every other error body has."""
    failed = final("error").model_copy(update={"error": "the engine died"})
    response = final_output(failed, "")["response"]
    assert response["status_code"] == 500
    assert response["body"] == {
        "error": {"message": "the engine died", "type": "server_error", "param": None, "code": None}
    }


def test_a_prompt_the_engine_finds_too_long_is_a_400_not_a_500() -> None:
    too_long = final("error").model_copy(
        update={"error": f"{TOO_LONG_FOR_ENGINE}2100 tokens; the model takes at most 2048"}
    )
    out = final_output(too_long, "")
    assert out["response"]["status_code"] == 400
    assert "context_length_exceeded" in out["response"]["body"]["error"]["message"]
    failed = final_output(final("error").model_copy(update={"error": "engine died"}), "")
    assert failed["response"]["status_code"] == 500


def test_a_conversation_the_chat_template_refuses_is_a_400_not_a_500() -> None:
    refused = final("error").model_copy(
        update={"error": "the chat template refused the conversation: roles must alternate"}
    )
    out = final_output(refused, "")
    assert out["response"]["status_code"] == 400
    assert out["response"]["body"]["error"]["param"] == "body.messages"


def test_a_refusal_is_the_http_error() -> None:
    out = refused_output("q-1", "bl_1", 401, "invalid key", "authentication_error")
    assert out["response"]["status_code"] == 401
    assert out["response"]["body"]["error"]["type"] == "authentication_error"


async def test_a_line_above_its_tiers_whole_minute_of_tokens_is_refused_not_held() -> None:
    """Charged more than the tier's tokens a minute, the line would wait for room in
    the quota for good, and every later line of its tenant behind it."""
    tiny = TierPolicy(
        band="batch", requests_per_minute=100, tokens_per_minute=50, concurrent_streams=1
    )
    settings = Settings(tiers=Settings().tiers | {"tiny": tiny})
    checks = ReplyChecks(settings, DefaultModerator(), cast(Quotas, None))  # nothing charged
    caller = Principal("u", "tiny", "k")

    def asking(max_tokens: int) -> BatchInputLine:
        hi = [{"role": "user", "content": "Hi"}]
        model = next(iter(settings.models))
        parsed = parse_line(line(body={"model": model, "max_tokens": max_tokens, "messages": hi}))
        assert parsed.line is not None
        return parsed.line

    fits = await prompt_for(checks, caller, "b1", asking(1))
    assert fits.charged_tokens <= 50
    with pytest.raises(Refused) as refused:
        await prompt_for(checks, caller, "b1", asking(50))
    assert refused.value.status == 413 and "50 a minute" in refused.value.message


async def test_a_lines_end_user_is_logged_as_over_http(caplog: pytest.LogCaptureFixture) -> None:
    """`user` was taken and dropped: abuse tracing had the HTTP API's calls only."""
    settings = Settings()
    checks = ReplyChecks(settings, DefaultModerator(), cast(Quotas, None))
    model = next(iter(settings.models))
    hi = [{"role": "user", "content": "Hi"}]
    parsed = parse_line(line(body={"model": model, "messages": hi, "user": "end-user-7"}))
    assert parsed.line is not None
    with caplog.at_level(logging.INFO, logger="producers.admission.lines"):
        await prompt_for(checks, Principal("u", "batch", "k"), "b1", parsed.line)
    assert any("end-user-7" in r.getMessage() for r in caplog.records)


async def test_a_lines_refusal_names_its_field_under_body_with_openais_code() -> None:
    """Refused lines had `code: null` where HTTP says model_not_found or
    context_length_exceeded, and named `messages` or no field at all, not where the
    line holds it."""
    settings = Settings()
    checks = ReplyChecks(settings, DefaultModerator(), cast(Quotas, None))
    caller = Principal("u", "batch", "k")
    model = next(iter(settings.models))

    async def refusal(body: dict[str, object]) -> Refused:
        parsed = parse_line(line(body=body))
        assert parsed.line is not None
        with pytest.raises(Refused) as refused:
            await prompt_for(checks, caller, "b1", parsed.line)
        return refused.value

    unknown = await refusal({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
    assert (unknown.status, unknown.code, unknown.param) == (404, "model_not_found", "body.model")
    long = [{"role": "user", "content": "word " * 3000}]
    too_long = await refusal({"model": model, "messages": long})
    assert too_long.code == "context_length_exceeded" and too_long.param == "body.messages"
    invalid = parse_line(line(body={"model": model, "messages": [], "temperature": 9}))
    assert invalid.problem is not None and invalid.problem.param == "body.temperature"
    out = refused_output("q-1", "bl_1", 404, "no model", param="body.model", code="model_not_found")
    assert out["response"]["body"]["error"]["code"] == "model_not_found"
