"""A batch line from `batch.requests` checked exactly as the same request is checked over
HTTP (the OpenAI request model, moderation of every message, the tier's reply limit,
the context window), and the prompt it becomes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producers.gateway.chat.checks import ReplyChecks
from producers.gateway.chat.protocol import sampling_for
from producers.gateway.errors import ApiError, unknown_model
from producers.gateway.openai_api.protocol import ChatCompletionRequest
from schemas.batch import MAX_CUSTOM_ID_CHARS, custom_line_request_id
from schemas.errors import MAX_MESSAGE_CHARS, shortened
from schemas.events import PromptRequest, now_ms
from tandoor.policies.api_keys import Principal
from tandoor.settings import BATCH_BAND

log = logging.getLogger(__name__)


class BatchInputLine(BaseModel):
    """One line of OpenAI's batch input."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=MAX_CUSTOM_ID_CHARS)
    method: Literal["POST"]
    url: Literal["/v1/chat/completions"]
    body: ChatCompletionRequest


class Refused(Exception):
    """A line that is answered with an error result (a 4xx; a 500 for a defect) and never
    forwarded."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        kept: bool = True,
        code: str | None = None,
    ) -> None:
        message = shortened(message, MAX_MESSAGE_CHARS)  # logged, and quoting the line
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.kept = kept  # False: on `batch.results` only (a row would replace another's)
        self.code = code  # OpenAI's, as over HTTP


@dataclass(frozen=True)
class Parsed:
    custom_id: str | None  # None when the line is not even JSON with a custom_id
    line: BatchInputLine | None
    problem: Refused | None


def parse_line(raw: bytes | None) -> Parsed:
    """The line, or what is wrong with it (with its custom_id where one can be read)."""
    try:
        data = orjson.loads(raw or b"")
    except orjson.JSONDecodeError as exc:
        return Parsed(
            None, None, Refused(400, f"the line is not JSON: {exc}", "invalid_request_error")
        )
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    custom_id = custom_id[:MAX_CUSTOM_ID_CHARS] if isinstance(custom_id, str) else None
    custom_id = custom_id or None
    try:
        return Parsed(custom_id, BatchInputLine.model_validate(data), None)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = f"{where or 'line'}: {first.get('msg', 'invalid')}"
        problem = Refused(400, message, "invalid_request_error", where or None)
        return Parsed(custom_id, None, problem)
    except Exception:  # a defect met by this input: the line fails alone, as over HTTP
        # (raised on, admission stopped at the line after every restart)
        log.exception("a batch line (custom_id %r) could not be read", custom_id)
        message = "internal error reading the line; it is logged, please report it"
        return Parsed(custom_id, None, Refused(500, message, "api_error"))


async def prompt_for(
    checks: ReplyChecks,
    caller: Principal,
    batch_id: str,
    line: BatchInputLine,
    deadline_ms: int | None = None,
) -> PromptRequest:
    """The line as a batch-band prompt, or Refused with the status the API would give.
    A worker that reaches it only after `deadline_ms` answers it as expired."""
    try:
        prompt = await _prompt(checks, caller, batch_id, line)
    except ApiError as exc:  # its field named as in the line: under `body`
        param = None if exc.param is None else exc.param.removeprefix("body.")
        where = None if param is None else f"body.{param}"
        raise Refused(exc.status, exc.message, exc.kind, where, code=exc.code) from exc
    return prompt.model_copy(update={"deadline_ms": deadline_ms})


async def _prompt(
    checks: ReplyChecks, caller: Principal, batch_id: str, line: BatchInputLine
) -> PromptRequest:
    body = line.body
    if body.model not in checks.settings.models:
        raise unknown_model(body.model, param="body.model")
    if body.stream:
        raise ApiError(400, "a batch line cannot stream: omit `stream`", param="body.stream")
    if body.end_user:  # as over HTTP: for abuse tracing
        log.info("batch %r line for end user %r of %s", batch_id, body.end_user, caller.user_id)
    checked = [(m.content, f"body.messages.{i}.content") for i, m in enumerate(body.messages)]
    texts = await checks.all_moderated(checked)
    messages = body.chat_messages(texts)
    if messages[-1].role != "user":
        raise ApiError(400, "the last message must be from the user", param="body.messages")
    options = body.reply_options()
    max_tokens = checks.max_tokens(caller, options, body.model)
    length = options.length_param
    context = checks.context(body.model, messages, max_tokens, True, length_param=length)
    checks.affordable(caller.tier, context.prompt_tokens + max_tokens, length)  # else held for good
    request_id = custom_line_request_id(caller.user_id, batch_id, line.custom_id)
    return PromptRequest(
        request_id=request_id,
        model=body.model,
        user_id=caller.user_id,
        tier=caller.tier,
        band=BATCH_BAND,
        conversation_id=request_id,  # spreads the lines over the band's partitions
        messages=context.messages,
        sampling=sampling_for(options, max_tokens),
        created_at_ms=now_ms(),  # reset when its quota is charged
        kind="batch",
        batch_id=batch_id,
        custom_id=line.custom_id,
        prompt_tokens_estimate=context.prompt_tokens,
        charged_tokens=context.prompt_tokens + max_tokens,
        store=False,  # a batch line is no conversation; its result and usage are kept
    )
