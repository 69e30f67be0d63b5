"""Calls to a Redis that stopped answering fail at once for a while. A server that took
the connection and went quiet (stopped, swapping, its host stalled) cost each call the
whole read timeout before its caller's Redis-down policy applied: a paid chat message
makes about seven calls, so it waited some 14 s. Once one call times out, the calls of
the next few seconds are refused as timed out without being sent; then they are tried
again, and the first to time out opens the breaker again."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

OPEN_S = 5.0  # short against an outage, long against the calls of one request


class RedisBreaker:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._open_until = 0.0

    @property
    def open(self) -> bool:
        return self._clock() < self._open_until

    def check(self) -> None:
        """Raises, as a timeout, while a recent call timed out."""
        if self.open:
            raise RedisTimeoutError(
                f"Redis stopped answering (a call timed out within {OPEN_S:.0f} s): not asked"
            )

    def timed_out(self) -> None:
        if not self.open:
            log.warning("a Redis call timed out: calls fail at once for %.0f s", OPEN_S)
        self._open_until = self._clock() + OPEN_S


class GuardedConnection(aioredis.Connection):
    """redis-py's connection, refusing to connect or send while its pool's breaker is
    open, and opening it on a timeout."""

    def __init__(self, *, breaker: RedisBreaker, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.breaker = breaker

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        """A reconnect is guarded too: a call timed out drops its connection, and a host
        gone quiet at the network (paused, partitioned) times out the connect instead."""
        if self.is_connected:
            return
        self.breaker.check()
        try:
            await super().connect_check_health(check_health, retry_socket_connect)
        except RedisTimeoutError:
            self.breaker.timed_out()
            raise

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        self.breaker.check()
        await super().send_packed_command(command, check_health)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except RedisTimeoutError:
            self.breaker.timed_out()
            raise
