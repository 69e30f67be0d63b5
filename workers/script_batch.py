"""Calls of one Redis script made in the same turn of the event loop go to Redis in one
pipeline. A worker records each request's token event before publishing it, and an
engine step hands every running request its next tokens at once: at 32 streams that
was 32 round trips per step, each a wake-up of Redis and of the worker's event loop
on the cores the engine computes on."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError
from redis.typing import EncodableT, KeyT

Call = tuple[Sequence[KeyT], Sequence[EncodableT], "asyncio.Future[Any]"]


class BatchedScript:
    def __init__(self, client: aioredis.Redis, script: AsyncScript) -> None:
        self._client = client
        self._script = script
        self._waiting: list[Call] = []
        self._flushes: set[asyncio.Task[None]] = set()

    async def __call__(self, keys: Sequence[KeyT], args: Sequence[EncodableT]) -> Any:
        """The script's reply for this call, or the error Redis (or reaching it) gave."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((keys, args, future))
        if len(self._waiting) == 1:
            # A task's first step runs in the loop's next turn: after this turn's callers.
            flush = asyncio.ensure_future(self._flush())
            self._flushes.add(flush)
            flush.add_done_callback(self._flushes.discard)
        return await future

    async def _flush(self) -> None:
        calls, self._waiting = self._waiting, []
        try:
            replies = await self._sent_again_if_scripts_lost(calls, await self._send(calls))
        except asyncio.CancelledError:  # the worker is stopping: so are its callers
            for *_, future in calls:
                future.cancel()
            raise
        except Exception as exc:  # reaching Redis failed: every call in it did
            for *_, future in calls:
                if not future.done():
                    future.set_exception(exc)
            return
        for (*_, future), reply in zip(calls, replies, strict=True):
            if future.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _sent_again_if_scripts_lost(self, calls: list[Call], replies: list[Any]) -> list[Any]:
        """The calls name the script by its digest alone: Redis without it (just started,
        restarted, failed over) answers each NOSCRIPT, which is no "Redis down" (it
        stopped the worker). Loaded then, they are tried once more."""
        lost = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            await self._client.script_load(self._script.script)
            for i, reply in zip(lost, await self._send([calls[i] for i in lost]), strict=True):
                replies[i] = reply
        return replies

    async def _send(self, calls: list[Call]) -> list[Any]:
        """One round trip: a script registered on the pipeline made it ask Redis first
        (SCRIPT EXISTS) whether it had the script, a second one before every event."""
        async with self._client.pipeline(transaction=False) as pipe:
            for keys, args, _ in calls:
                pipe.evalsha(self._script.sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))
