"""What a worker refuses to run: prompts no gateway could have made (written straight to
the topic), whose answers would be too large for Kafka or whose reply would cost every
stream on the worker. Refused as undecodable: dead-lettered, with a short error final."""

from __future__ import annotations

from schemas.batch import MAX_CUSTOM_ID_CHARS
from schemas.codec import SchemaError
from schemas.events import (
    MAX_CONVERSATION_MESSAGES,
    MAX_ID_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    FinalEvent,
    PromptRequest,
    Usage,
    now_ms,
)
from tandoor.policies.redis_keys import ATTEMPT_TTL_S

# Each answer carries these again (the schema cannot bound them without a new version):
# a 600 KB one made every answer too large for Kafka, and every worker given the
# partition stopped on it in turn.
TEXT_LIMITS = {  # characters
    "request_id": MAX_ID_CHARS,
    "user_id": MAX_ID_CHARS,
    "conversation_id": MAX_ID_CHARS,
    "batch_id": MAX_ID_CHARS,
    "custom_id": MAX_CUSTOM_ID_CHARS,
    "model": MAX_ID_CHARS,  # an unknown model's error final quotes it twice
    "tier": MAX_ID_CHARS,
}
MAX_REASON_CHARS = 1000  # an undecodable prompt's reason, which may quote its bad value


def answerable(prompt: PromptRequest) -> PromptRequest:
    """The prompt, or a SchemaError naming the field no gateway would have sent."""
    for field, limit in TEXT_LIMITS.items():
        if len(getattr(prompt, field) or "") > limit:
            raise SchemaError(f"field {field!r}: longer than {limit} characters", field)
    if len(prompt.replaces) > MAX_CONVERSATION_MESSAGES:
        raise SchemaError(
            f"field 'replaces': more than {MAX_CONVERSATION_MESSAGES} messages", "replaces"
        )
    if any(len(key.message_id) > MAX_ID_CHARS for key in prompt.replaces):
        raise SchemaError(f"field 'replaces': an id longer than {MAX_ID_CHARS}", "replaces")
    _check_stops(prompt.sampling.stop)
    return prompt


def _check_stops(stop: list[str]) -> None:
    """vLLM looks for every stop string at each new token, on the worker's event loop:
    250,000 of them slowed every stream the worker ran."""
    if len(stop) > MAX_STOP_SEQUENCES:
        raise SchemaError(f"field 'stop': more than {MAX_STOP_SEQUENCES} strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise SchemaError(f"field 'stop': a string longer than {MAX_STOP_CHARS}", "stop")


def outlived_its_marks(prompt: PromptRequest) -> bool:
    """Read more than a day after it was made (ATTEMPT_TTL_S, the life of its done mark)
    with its deadline past: whether it was answered can no longer be told (finished but
    not committed behind a longer prompt, then its model stopped for a weekend), and an
    `expired` final sent again replaced its stored reply. A line with no deadline (a
    Kafka client's batch line) still runs."""
    now = now_ms()
    old = now - prompt.created_at_ms > ATTEMPT_TTL_S * 1000
    return old and prompt.deadline_ms is not None and prompt.deadline_ms < now


def malformed_final(request_id: str, model: str, error: str) -> FinalEvent:
    usage = Usage(prompt_tokens=0, completion_tokens=0, queue_ms=0, decode_ms=0)
    if len(error) > MAX_REASON_CHARS:
        error = error[:MAX_REASON_CHARS] + "..."
    return FinalEvent(
        request_id=request_id,
        attempt=1,
        seq=0,
        finish_reason="error",
        error=f"malformed prompt: {error}",
        text="",
        usage=usage,
        model=model,
        user_id="",
        tier="",
        conversation_id="",
        created_at_ms=now_ms(),
    )
