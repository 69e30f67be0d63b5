"""Request and response bodies of the conversations API."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

TITLE_MAX = 200  # a title the user chooses
# A title Tandoor makes: the model's (a background job), or until then the first message's
# opening words, which the chat page sends too (web/app.js; a unit test keeps them equal).
AUTO_TITLE_CHARS = 60


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
    created_at: dt.datetime
    updated_at: dt.datetime


class Message(BaseModel):
    id: str
    role: str
    content: str
    status: str | None
    created_at: dt.datetime
    model: str | None = None
    attempt: int | None = None
    finish_reason: str | None = None


class ConversationWithMessages(Conversation):
    messages: list[Message]
    summary: str | None = Field(
        default=None, description="The model's summary of the turns up to summary_until."
    )
    summary_until: dt.datetime | None = None
    # Internal: the summary covers a turn replaced after it was written (an edit whose
    # forgetting of it failed), so it is not used. A turn replaced before was never in it.
    summary_stale: SkipJsonSchema[bool] = Field(default=False, exclude=True)


class ConversationPage(BaseModel):
    data: list[Conversation]
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next page; null on the last page."
    )
