"""A chat deleted while another tab posts to it: the reply claimed while the rows went
is stopped too (pure logic: the real delete route and stop, stand-ins for Redis,
Cassandra and Kafka)."""

from __future__ import annotations

from typing import Any, cast

from producers.gateway.chat.control import ReplyControl
from producers.gateway.conversations.router import delete
from producers.gateway.errors import ApiError
from tandoor.policies.api_keys import Principal
from tandoor.policies.redis_keys import cancel_key
from tandoor.settings import Settings


class InFlight:
    """The conversation's in-flight record, as Redis holds it, and the cancels set."""

    def __init__(self) -> None:
        self.record: dict[str, Any] | None = None
        self.redis = self
        self.cancels: list[str] = []

    async def running(self, conversation_id: str, missing_status: int) -> dict[str, Any]:
        if self.record is None:
            raise ApiError(missing_status, "no reply is being generated")
        return self.record

    async def end_untaken(self, record: dict[str, Any], user_id: str, tier: str) -> None:
        return None

    async def set(self, key: str, value: object, ex: int) -> None:
        self.cancels.append(key)


class Kafka:
    async def send_and_wait(self, topic: str, value: bytes, key: bytes) -> None:
        return None


class Conversations:
    """The user's chat, deleted; another tab's post claims it while the rows go."""

    def __init__(self, inflight: InFlight) -> None:
        self.inflight, self.deleted = inflight, False

    async def owned(self, user_id: str, conversation_id: str) -> None:
        if self.deleted:
            raise ApiError(404, "conversation not found")

    async def delete(self, user_id: str, conversation_id: str) -> None:
        self.inflight.record = {"request_id": "r_other_tab", "partition": 0}
        self.deleted = True


class Chat:
    def __init__(self, running: ReplyControl) -> None:
        self.running = running


async def test_a_reply_claimed_while_its_chat_is_deleted_is_stopped() -> None:
    """The delete stopped what ran before it, then deleted the rows: a post from another
    tab that claimed the chat in between passed its checks (the rows were still there)
    and its reply ran on, charged, for a chat that answers 404."""
    inflight = InFlight()
    conversations = Conversations(inflight)
    control = ReplyControl(
        Settings(),
        cast(Any, conversations),
        cast(Any, Kafka()),
        cast(Any, inflight),
        cast(Any, None),
    )
    caller = Principal("u", "free", "k")
    answer = await delete("c_1", caller, cast(Any, conversations), cast(Any, Chat(control)))
    assert answer.status_code == 204
    assert inflight.cancels == [cancel_key("r_other_tab")]
