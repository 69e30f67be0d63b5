"""What `tandoor ask` sends, and prints of a reply's token events."""

from __future__ import annotations

from producers.ask import Shown, ask_request
from schemas.events import TokenEvent


def token(attempt: int, seq: int, delta: str) -> TokenEvent:
    return TokenEvent(
        request_id="ask-1", attempt=attempt, seq=seq, delta=delta, token_count=1, created_at_ms=1
    )


def test_events_sent_again_by_a_worker_taking_over_are_printed_once() -> None:
    """Every delta was printed in arrival order: "HelloHello!" for "Hello!"."""
    shown = Shown()
    events = [token(1, 0, "Hel"), token(1, 1, "lo"), token(1, 0, "Hel"), token(1, 1, "lo")]
    events.append(token(1, 2, "!"))
    assert "".join(shown.text_of(e) for e in events) == "Hello!"


def test_a_restart_is_said_not_run_together() -> None:
    shown = Shown()
    events = [token(1, 0, "Hel"), token(2, 0, "Hi"), token(2, 1, " there")]
    assert "".join(shown.text_of(e) for e in events) == "Hel\n[the reply restarted]\nHi there"


def test_its_prompt_keeps_no_conversation_that_no_one_owns() -> None:
    """Its conversation is opened by no gateway: a stored reply and conversation row had no
    owner to read or delete them (one more at each smoke test)."""
    request = ask_request("What is the capital of France?", "smollm2", "interactive", 8)
    assert request.store is False
    assert request.user_id == "cli" and request.sampling.max_tokens == 8
