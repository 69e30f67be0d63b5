"""Request and response bodies of the conversations API."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, WithJsonSchema
from pydantic.json_schema import SkipJsonSchema

TITLE_MAX = 200  # a title the user chooses
# A title Tandoor makes: the model's (a background job), or until then the first message's
# opening words, which the chat page sends too (web/app.js; a unit test keeps them equal).
AUTO_TITLE_CHARS = 60


def utc_ms(at: dt.datetime) -> str:
    """UTC to the millisecond (what Cassandra keeps), always with its fraction: pydantic
    wrote "...:01Z" at a whole second and "...:01.500000Z" otherwise, and "." sorts
    before "Z", so a client sorting times as text put a whole second after the later
    times in it."""
    at = at.astimezone(dt.UTC)
    return f"{at:%Y-%m-%dT%H:%M:%S}.{at.microsecond // 1000:03d}Z"


Timestamp = Annotated[
    dt.datetime,
    PlainSerializer(utc_ms, return_type=str, when_used="json"),
    # Still a date-time to clients generated from the OpenAPI schema (the serializer
    # alone made it a plain string there).
    WithJsonSchema({"type": "string", "format": "date-time"}, mode="serialization"),
]


def provisional_title(first_message: str) -> str | None:
    """What a new conversation is called until the model names it."""
    return first_message[:AUTO_TITLE_CHARS] or None


class CreateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="Defaults to the first served model.")
    title: str | None = Field(default=None, min_length=1, max_length=TITLE_MAX)


class RenameConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: str = Field(min_length=1, max_length=TITLE_MAX)


class Conversation(BaseModel):
    id: str
    model: str
    title: str | None
    created_at: Timestamp
    updated_at: Timestamp


class Message(BaseModel):
    id: str
    role: str
    content: str
    status: str | None
    created_at: Timestamp
    model: str | None = None
    attempt: int | None = None
    finish_reason: str | None = None


class ConversationWithMessages(Conversation):
    messages: list[Message]
    summary: str | None = Field(
        default=None, description="The model's summary of the turns up to summary_until."
    )
    summary_until: Timestamp | None = None
    # Internal: the summary covers a turn replaced after it was written (an edit whose
    # forgetting of it failed), so it is not used. A turn replaced before was never in it.
    summary_stale: SkipJsonSchema[bool] = Field(default=False, exclude=True)


class ConversationPage(BaseModel):
    data: list[Conversation]
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next page; null on the last page."
    )
