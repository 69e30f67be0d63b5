"""Stopping and resuming the reply a conversation is generating, from any gateway: what
they know of it is its in-flight record (inflight.py), not the gateway that started it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any

from aiokafka.errors import KafkaError

from consumers.fanout import Delivered, read_request
from producers.control import request_cancel
from producers.gateway.chat.inflight import InFlight, charged_tier
from producers.gateway.chat.sse import reply_tag
from producers.gateway.chat.watch import KEEPALIVE_S, with_keepalives
from producers.gateway.conversations.service import ConversationService
from producers.gateway.errors import ApiError, kafka_unreachable
from schemas import topics
from schemas.codec import encode
from schemas.events import FinalEvent
from tandoor.background import Background
from tandoor.clients import REDIS_DOWN
from tandoor.policies.api_keys import Principal
from tandoor.policies.quota import Admission, Quotas
from tandoor.policies.redis_keys import quota_account
from tandoor.renewing_producer import RenewingProducer
from tandoor.settings import Settings

log = logging.getLogger(__name__)


class Resumed:
    """A running reply, resumed: its in-flight record, and its events from the start."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        self.events: AsyncGenerator[Delivered | None, None]  # set once it is read
        self.ending = False  # its end is in, its record released: a drain lets it finish


class ReplyControl:
    def __init__(
        self,
        settings: Settings,
        conversations: ConversationService,
        producer: RenewingProducer,
        inflight: InFlight,
        quotas: Quotas,
    ) -> None:
        self.settings = settings
        self.conversations = conversations
        self.producer = producer
        self.inflight = inflight
        self.quotas = quotas
        self.background = Background()  # stops of replies their clients left, and such

    async def stop(self, caller: Principal, conversation_id: str) -> str:
        await self.conversations.owned(caller.user_id, conversation_id)
        return await self._stop_running(caller, conversation_id)

    async def _stop_running(self, caller: Principal, conversation_id: str) -> str:
        record = await self.inflight.running(conversation_id, 409)
        try:
            timeout_s = self.settings.kafka_send_timeout_s
            await asyncio.wait_for(self._stop(record, caller), timeout_s)
        except (KafkaError, TimeoutError) as exc:
            # The cancel is in Redis: a worker that takes the prompt later drops it.
            raise kafka_unreachable(
                "the stop did not reach the workers (Kafka); the reply may go on, please retry"
            ) from exc
        return str(record["request_id"])

    async def stop_if_running(
        self, caller: Principal, conversation_id: str, owned: bool = False
    ) -> None:
        """Before a conversation is deleted: its running reply is stopped. Left running,
        nobody could stop it (stop and resume answer 404 once the chat is gone), and it
        held the caller's stream slot, a free user's only one, until it ended. `owned`:
        the caller's, checked already (once deleted, `stop` answers 404)."""
        try:
            await (self._stop_running if owned else self.stop)(caller, conversation_id)
        except ApiError as exc:  # none running (409); not the caller's (404: delete says so)
            if exc.status >= 500:  # the cancel is in Redis: a worker taking it drops it
                log.warning("%s: its reply's stop reached no worker (Kafka)", conversation_id)
        except REDIS_DOWN as exc:
            log.warning("%s: deleted without stopping its reply (%r)", conversation_id, exc)

    def stop_left(self, caller: Principal, conversation_id: str, request_id: str) -> None:
        """A client that cannot resume (the OpenAI API) went before its reply ended: the
        reply is stopped as by the stop button, in the background (it would run on to
        max_tokens for no one, charged, holding the caller's stream slot)."""
        self.background.start(self._stop_left(caller, conversation_id, request_id))

    async def _stop_left(self, caller: Principal, conversation_id: str, request_id: str) -> None:
        try:
            record = await self.inflight.running(conversation_id, 409)
            if record.get("request_id") == request_id:  # not ended, nor another's since
                timeout_s = self.settings.kafka_send_timeout_s
                await asyncio.wait_for(self._stop(record, caller), timeout_s)
                log.info("%s: stopped, its client went", request_id)
        except ApiError:
            return  # ended meanwhile
        except REDIS_DOWN:  # its record unreadable: the call's conversation is its own
            await self._cancel(request_id, "its client went")
        except (KafkaError, TimeoutError) as exc:
            log.warning("%s: not stopped when its client went (%r)", request_id, exc)

    async def stop_given_up(self, request_id: str) -> None:
        """A reply silent past the tier's limit (its client told no worker answered) may
        still run, in a worker that took it over late or behind a stalled read: it is
        stopped, and its follower settles nothing. Settled at zero, it ran on uncharged
        (its real usage found the request settled) and holding no stream slot; whatever
        does run sends a usage record, which settles it."""
        await self._cancel(request_id, "the gateway gave up waiting for the reply")

    def stop_withdrawn(self, request_id: str) -> None:
        """A prompt whose send timed out may still reach Kafka, and a worker that takes
        it before its done mark did answered a message the client was told failed: it
        is stopped, in the background (Kafka is slow or away: the 503 does not wait)."""
        self.background.start(self._cancel(request_id, "its send timed out"))

    async def _cancel(self, request_id: str, reason: str) -> None:
        try:
            await asyncio.wait_for(
                request_cancel(self.producer, self.inflight.redis, request_id, reason),
                self.settings.kafka_send_timeout_s,
            )
        except (KafkaError, TimeoutError, *REDIS_DOWN) as exc:
            log.warning("%s: not stopped (%s: %r)", request_id, reason, exc)

    async def _stop(self, record: dict[str, Any], caller: Principal) -> None:
        request_id = str(record["request_id"])
        await request_cancel(self.producer, self.inflight.redis, request_id, "stop button")
        # Still waiting in Kafka: answered here and now. The stop showed only once a
        # worker reached the prompt (up to the queue's wait budget), and the
        # conversation refused new messages meanwhile.
        final = await self.inflight.end_untaken(record, caller.user_id, caller.tier)
        if final is not None:
            await self.producer.send_and_wait(
                topics.TOKENS, encode(final), key=request_id.encode(), partition=record["partition"]
            )

    async def resume(
        self, caller: Principal, conversation_id: str, reply: str | None = None
    ) -> Resumed:
        """The current reply's events from its start (the caller skips what was sent),
        with keep-alives, ending after the tier's silence limit. A 404 when no reply
        runs, when the one recorded will never answer (it hung until the record's hour
        was up), or when it is not the `reply` (tag) the client was shown."""
        await self.conversations.owned(caller.user_id, conversation_id)
        record = await self.inflight.running(conversation_id, 404)
        if await self.inflight.abandoned(record):
            raise ApiError(
                404, "no reply is being generated in this conversation", kind="not_found_error"
            )
        if reply is not None and reply_tag(record["request_id"]) != reply:
            raise ApiError(
                404,
                "the reply of this Last-Event-ID is no longer being generated (another is): "
                "reopen the conversation to see it",
                kind="not_found_error",
            )
        resumed = Resumed(record)
        events = read_request(
            self.settings, record["request_id"], record["partition"], record["offset"]
        )
        cleared = self._clearing_when_final(caller, conversation_id, resumed, events)
        silence_s = self.settings.silence_limit_s(caller.tier)
        resumed.events = with_keepalives(cleared, KEEPALIVE_S, silence_s)
        return resumed

    async def _clearing_when_final(
        self,
        caller: Principal,
        conversation_id: str,
        resumed: Resumed,
        events: AsyncGenerator[Delivered, None],
    ) -> AsyncGenerator[Delivered, None]:
        """A resumed reply whose gateway died: nobody else will mark it finished, nor
        free its concurrent-stream slot before the client hears the end (the streams app
        frees it once the usage record comes, after the final: a post right after the
        end was a 429 for a user of one stream). Its reader closes with it."""
        async with contextlib.aclosing(events):
            async for item in events:
                if isinstance(item.event, FinalEvent):  # before the client may close it
                    resumed.ending = True
                    # Done even if the client leaves meanwhile (that cancels this read).
                    freeing = self._free(caller, conversation_id, resumed)
                    await asyncio.shield(self.background.start(freeing))
                yield item

    async def _free(self, caller: Principal, conversation_id: str, resumed: Resumed) -> None:
        request_id = resumed.record["request_id"]
        await self.inflight.release(conversation_id, request_id)
        account = quota_account(caller.user_id, charged_tier(resumed.record, caller.tier))
        await self.quotas.release(Admission(account, request_id, 0, 0))
