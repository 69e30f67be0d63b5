"""A cancel with Redis down still reaches the workers running the request over the
control topic (stand-ins for Redis, Kafka and the in-flight records)."""

from __future__ import annotations

from typing import Any, cast

from redis.exceptions import ConnectionError as RedisConnectionError

from producers.control import request_cancel
from producers.gateway.chat.control import ReplyControl
from schemas import topics
from schemas.codec import decode
from schemas.events import ControlEvent
from tandoor.policies.api_keys import Principal
from tandoor.settings import Settings


class RedisDown:
    async def set(self, *args: Any, **kwargs: Any) -> None:
        raise RedisConnectionError("Redis is unreachable")

    async def get(self, *args: Any) -> None:
        raise RedisConnectionError("Redis is unreachable")


class Sent:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def send_and_wait(self, topic: str, value: bytes, key: bytes) -> None:
        assert topic == topics.CONTROL
        self.cancelled.append(decode(ControlEvent, value).request_id)


async def test_a_cancel_reaches_the_control_topic_with_redis_down() -> None:
    """Its Redis mark failing skipped the control event: no running worker was told."""
    producer = Sent()
    await request_cancel(cast(Any, producer), cast(Any, RedisDown()), "r_1", "stop")
    assert producer.cancelled == ["r_1"]


class InFlightDown:
    redis = RedisDown()

    async def running(self, conversation_id: str, missing_status: int) -> None:
        raise RedisConnectionError("Redis is unreachable")


async def test_an_api_reply_whose_client_went_is_stopped_with_redis_down() -> None:
    """Its record unreadable, nothing was sent: the reply ran on to max_tokens for no one,
    holding the caller's stream slot (a few SDK retries, and a 429)."""
    producer = Sent()
    stand_ins = cast(Any, None), cast(Any, producer), cast(Any, InFlightDown()), cast(Any, None)
    control = ReplyControl(Settings(), *stand_ins)
    control.stop_left(Principal("u1", "api", "k"), "c_api", "r_2")
    await control.background.finish(within_s=10)
    assert producer.cancelled == ["r_2"]
