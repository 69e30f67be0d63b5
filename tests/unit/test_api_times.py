"""Times in API replies: one fixed form, so clients that sort them as text sort them
right. Pydantic wrote "...:01Z" at a whole second and "...:01.500000Z" otherwise, and
"." sorts before "Z": a time on the second sorted after the later ones in it (a CI run
picked the wrong conversation as the oldest)."""

from __future__ import annotations

import datetime as dt

from producers.gateway.conversations.protocol import Conversation, ConversationWithMessages

ON_THE_SECOND = dt.datetime(2026, 12, 7, 6, 0, 1, tzinfo=dt.UTC)
LATER_IN_IT = ON_THE_SECOND + dt.timedelta(milliseconds=500)


def listed(at: dt.datetime) -> dict[str, str]:
    made = Conversation(id="c_1", model="m", title=None, created_at=at, updated_at=at)
    return dict(made.model_dump(mode="json"))


def test_times_sort_as_text_as_they_do_as_times() -> None:
    early, late = listed(ON_THE_SECOND), listed(LATER_IN_IT)
    assert early["created_at"] < late["created_at"], (early, late)


def test_times_are_utc_to_the_millisecond_and_read_back_the_same() -> None:
    shown = listed(LATER_IN_IT)["created_at"]
    assert shown == "2026-12-07T06:00:01.500Z"
    assert dt.datetime.fromisoformat(shown) == LATER_IN_IT
    other_zone = LATER_IN_IT.astimezone(dt.timezone(dt.timedelta(hours=2)))
    assert listed(other_zone)["created_at"] == shown


def with_messages(summary_until: dt.datetime | None) -> dict[str, object]:
    at = ON_THE_SECOND
    made = ConversationWithMessages(
        id="c_1",
        model="m",
        title=None,
        created_at=at,
        updated_at=at,
        messages=[],
        summary="s" if summary_until else None,
        summary_until=summary_until,
    )
    return dict(made.model_dump(mode="json"))


def test_a_summary_time_and_an_absent_one() -> None:
    whole = with_messages(ON_THE_SECOND)
    assert whole["summary_until"] == "2026-12-07T06:00:01.000Z"
    assert whole["created_at"] == "2026-12-07T06:00:01.000Z"
    assert with_messages(None)["summary_until"] is None


def test_the_openapi_schema_says_date_time() -> None:
    """Clients generated from the schema type these as times, not strings."""
    shown = ConversationWithMessages.model_json_schema(mode="serialization")
    fields = shown["properties"]
    assert fields["created_at"] == {"format": "date-time", "title": "Created At", "type": "string"}
    assert {"format": "date-time", "type": "string"} in fields["summary_until"]["anyOf"]
