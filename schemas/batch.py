"""How batch lines are named in the pipeline, and the OpenAI batch-output records their
results are published as.

A batch line is written to `batch.requests` in OpenAI's batch input form and named by
its tenant's `custom_id`: its request id is `bl_<digest>` of the owner, the batch id and
the custom_id, so the same line always has the same id.
"""

from __future__ import annotations

import hashlib
from typing import Any

from schemas.errors import error_body
from schemas.events import ANSWERED, TEMPLATE_REFUSED, TOO_LONG_FOR_ENGINE, FinalEvent

# Header names on `batch.requests` records (Kafka header names are case-sensitive).
AUTHORIZATION_HEADER = "authorization"
BATCH_ID_HEADER = "batch-id"
# Optional: when the batch's completion window ends (ms since the epoch). A line not
# started by then is answered `batch_expired` and never runs.
DEADLINE_HEADER = "batch-deadline-ms"
MAX_CUSTOM_ID_CHARS = 512
# A line is one Kafka record: under the producer's and broker's 1 MiB, with room for
# the headers. Far beyond any served model's context in any case.
MAX_LINE_BYTES = 1_000_000


def custom_line_request_id(user_id: str, batch_id: str, custom_id: str) -> str:
    digest = hashlib.sha256("\0".join([user_id, batch_id, custom_id]).encode())
    return f"bl_{digest.hexdigest()[:32]}"


def batch_output(
    custom_id: str | None,
    request_id: str,
    response: dict[str, Any] | None = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One line of OpenAI's batch output: `response` for an HTTP answer (2xx or 4xx),
    `error` for a line that ended without one (expired, cancelled)."""
    return {
        "id": f"batch_req_{request_id}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def refused_output(
    custom_id: str | None,
    request_id: str,
    status_code: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """A line refused before it reached a model: the error the same request gets over HTTP."""
    body = error_body(message, kind, param, code)
    return batch_output(
        custom_id, request_id, {"status_code": status_code, "request_id": request_id, "body": body}
    )


def too_large_output(custom_id: str | None, request_id: str, size: int) -> dict[str, Any]:
    """In place of an output past Kafka's record limit: sent again, it is refused again."""
    message = f"the result ({size} bytes) is too large to deliver"
    error = {"code": "result_too_large", "message": message}
    return batch_output(custom_id, request_id, error=error)


def cancelled_output(custom_id: str | None, request_id: str) -> dict[str, Any]:
    message = "the batch was cancelled before this line ran"
    return batch_output(
        custom_id, request_id, error={"code": "batch_cancelled", "message": message}
    )


def expired_output(custom_id: str | None, request_id: str) -> dict[str, Any]:
    message = "the batch's completion window ended before this line ran"
    return batch_output(custom_id, request_id, error={"code": "batch_expired", "message": message})


def final_output(final: FinalEvent, text: str) -> dict[str, Any]:
    """A batch line's result from its final event; `text` is the reply as stored (after
    output moderation)."""
    custom_id, request_id = final.custom_id, final.request_id
    if final.finish_reason == "expired":  # it waited in the model's topic past the window
        return expired_output(custom_id, request_id)
    if final.finish_reason == "cancelled" and not final.usage.completion_tokens:
        return cancelled_output(custom_id, request_id)  # never started: as admission says
    if final.finish_reason == "cancelled":
        message = "the batch was cancelled before this line finished"
        return batch_output(custom_id, request_id, error={"code": "cancelled", "message": message})
    if final.failed_with(TOO_LONG_FOR_ENGINE):
        # Past admission's estimate but not the engine's count: the request's fault, a 400
        # as over HTTP, not a 500 that invites a retry.
        message = f"context_length_exceeded: {final.error}"
        return refused_output(
            custom_id,
            request_id,
            400,
            message,
            param="body.messages",
            code="context_length_exceeded",
        )
    if final.failed_with(TEMPLATE_REFUSED):
        return refused_output(custom_id, request_id, 400, final.error or "", param="body.messages")
    if final.finish_reason not in ANSWERED:
        message = final.error or "the model could not answer"
        failed = error_body(message, "server_error")
        return batch_output(
            custom_id, request_id, {"status_code": 500, "request_id": request_id, "body": failed}
        )
    usage = final.usage
    body: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": final.created_at_ms // 1000,
        "model": final.model,
        "choices": [
            {
                "index": 0,
                "finish_reason": final.finish_reason,
                "message": {"role": "assistant", "content": text},
            }
        ],
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        },
    }
    return batch_output(
        custom_id, request_id, {"status_code": 200, "request_id": request_id, "body": body}
    )
