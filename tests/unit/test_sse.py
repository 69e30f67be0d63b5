from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
import pytest

from consumers.fanout import Delivered
from producers.gateway.chat.sse import ResumePoint, reply_frames, reply_tag
from producers.gateway.errors import ApiError
from schemas.events import Event, FinalEvent, TokenEvent, Usage
from tandoor.policies.moderation import StreamRedactor

USAGE = Usage(prompt_tokens=5, completion_tokens=3, queue_ms=0, decode_ms=0)
TAG = reply_tag("r")  # the reply's name in its event ids


def token(delta: str, seq: int, attempt: int = 1) -> TokenEvent:
    return TokenEvent(
        request_id="r", attempt=attempt, seq=seq, delta=delta, token_count=1, created_at_ms=0
    )


def final(text: str, attempt: int = 1) -> FinalEvent:
    return FinalEvent(
        request_id="r",
        attempt=attempt,
        seq=9,
        finish_reason="stop",
        text=text,
        usage=USAGE,
        model="m",
        user_id="u",
        tier="t",
        conversation_id="c",
        created_at_ms=0,
    )


async def feed(*events: Event) -> AsyncIterator[Delivered | None]:
    for offset, event in enumerate(events):
        assert isinstance(event, TokenEvent | FinalEvent)
        yield Delivered(0, offset, event)


async def frames(events: Sequence[Event], resume: str | None = None) -> list[dict[str, Any]]:
    out = []
    async for chunk in reply_frames(feed(*events), StreamRedactor, ResumePoint.parse(resume)):
        lines = dict(line.split(": ", 1) for line in chunk.strip().splitlines() if ": " in line)
        if "data" in lines and lines["data"] != "[DONE]":
            out.append({"id": lines.get("id"), **orjson.loads(lines["data"])})
    return out


def text(out: list[dict[str, Any]]) -> str:
    return "".join(f["delta"] for f in out if f["type"] == "token")


REPLY = [
    token("Hello", 0),
    token(" there,", 1),
    token(" mail", 2),
    token(" me", 3),
    final("Hello there, mail me"),
]


async def test_text_arrives_in_order_with_ids_counting_characters() -> None:
    out = await frames(REPLY)
    assert text(out) == "Hello there, mail me"
    assert out[-1]["type"] == "final" and out[-1]["id"] == f"{TAG}.1.20"


async def test_duplicates_are_skipped() -> None:
    out = await frames([token("Hi", 0), token(" you", 1), token(" you", 1), final("Hi you")])
    assert text(out) == "Hi you"


async def test_a_higher_attempt_restarts_and_a_late_lower_one_is_ignored() -> None:
    events = [
        token("Par", 0),
        token("tial", 1),
        token("New ", 0, attempt=2),
        token("ignored", 2),
        token("text", 1, attempt=2),
        final("New text", attempt=2),
    ]
    out = await frames(events)
    restart = [i for i, f in enumerate(out) if f["type"] == "restart"]
    assert len(restart) == 1 and out[restart[0]]["attempt"] == 2
    assert text(out[restart[0] :]) == "New text"


async def test_resume_sends_exactly_what_the_client_lacks() -> None:
    full = await frames(REPLY)
    cuts = [f["id"] for f in full if f["id"]][:-1]
    assert len(cuts) >= 3, full  # or nothing below was tried
    for cut in cuts:
        have = int(cut.split(".")[2])
        rest = await frames(REPLY, resume=cut)
        assert "Hello there, mail me"[:have] + text(rest) == "Hello there, mail me", cut
        assert not any(f["type"] == "restart" for f in rest)


async def test_resume_from_an_older_attempt_restarts() -> None:
    events = [token("New", 0, attempt=2), final("New", attempt=2)]
    out = await frames(events, resume=f"{TAG}.1.7")
    assert out[0]["type"] == "restart" and text(out) == "New"


async def test_events_ending_without_a_final_give_a_clear_error() -> None:
    out = await frames([token("Hal", 0)])
    assert out[-1]["type"] == "error" and "no worker answered" in out[-1]["error"]


async def test_a_continued_reply_shows_each_event_once() -> None:
    """A worker that takes the reply over republishes what the first had sent (some of
    it lost with it), then goes on: the client sees one reply, no restart."""
    events: list[Event] = [token("Once", 0), token(" upon", 1), token("Once", 0)]
    events += [token(" upon", 1), token(" a", 2), token(" time", 3), final("Once upon a time")]
    out = await frames(events)
    assert text(out) == "Once upon a time"
    assert not any(f["type"] == "restart" for f in out)


async def test_a_missing_event_is_filled_in_from_the_final() -> None:
    events = [token("Once", 0), token(" a", 2), token(" time", 3), final("Once upon a time")]
    out = await frames(events)
    assert text(out) == "Once upon a time"
    assert not any(f["type"] == "restart" for f in out)
    assert out[-1]["id"] == f"{TAG}.1.16"


async def test_text_shown_that_differs_from_the_final_is_replaced_by_it() -> None:
    out = await frames([token("Once upon", 0), final("Twice")])
    restart = [i for i, f in enumerate(out) if f["type"] == "restart"]
    assert len(restart) == 1 and text(out[restart[0] :]) == "Twice"


async def test_resume_during_a_later_attempt_shows_that_attempt_whole() -> None:
    """The replay holds the abandoned attempt 1 first: it is skipped, and the client
    (which has 3 characters of attempt 2) gets the rest of attempt 2, not less."""
    events: list[Event] = [token("Old", 0), token("New", 0, attempt=2)]
    events += [token(" text", 1, attempt=2), final("New text", attempt=2)]
    out = await frames(events, resume=f"{TAG}.2.3")
    assert not any(f["type"] == "restart" for f in out)
    assert "New"[:3] + text(out) == "New text"


async def test_an_id_of_an_attempt_never_sent_still_gets_the_reply_and_its_final() -> None:
    """Every event, the final's too, was skipped as older than the id: the client got
    keep-alives, then "no worker answered", for a reply that had completed."""
    out = await frames(REPLY, resume=f"{TAG}.7.0")
    assert out[0]["type"] == "restart"
    assert text(out) == "Hello there, mail me" and out[-1]["type"] == "final"


async def test_an_id_from_before_replies_were_named_still_resumes() -> None:
    """A page loaded before an upgrade sends `<attempt>.<characters>`."""
    rest = await frames(REPLY, resume="1.5")
    assert "Hello" + text(rest) == "Hello there, mail me"


@pytest.mark.parametrize(
    "event_id", ["zzzzzzzz.1.1", f"{TAG}x.1.1", f"{TAG}..1", f"a.{TAG}.1.1", "1", "", "a.b"]
)
def test_ids_this_gateway_never_sends_are_a_400(event_id: str) -> None:
    with pytest.raises(ApiError) as refused:
        ResumePoint.parse(event_id)
    assert refused.value.status == 400


def test_ids_name_their_reply() -> None:
    point = ResumePoint.parse(f"{TAG}.2.30")
    assert point == ResumePoint(TAG, 2, 30) and reply_tag("another") != TAG


async def test_each_event_yields_before_the_next_is_awaited() -> None:
    """An event the redaction held whole ("wor", until its word ends) made no frame, and
    the frame before it was kept to go out with the next one, seconds away in a pause
    of the model (up to the 15 s keep-alive). Each event now yields (an empty string
    where it made no frame), so the stream writes what it has."""
    events: list[Event] = [token("Hello there, ", 0), token("wor", 1), token("ld. ", 2)]
    consumed = 0

    async def counted() -> AsyncIterator[Delivered | None]:
        nonlocal consumed
        async for item in feed(*events, final("Hello there, world. ")):
            consumed += 1
            yield item

    yielded_after = [consumed async for _ in reply_frames(counted(), StreamRedactor)]
    assert set(yielded_after) == {1, 2, 3, 4}
