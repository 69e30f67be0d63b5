"""What admission keeps in Redis and in memory about lines and keys: where each handled
line was read (so a line read again after a crash is skipped), which batches were
cancelled, and the keys it has resolved lately."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from producers.admission.stored_cancels import StoredCancels
from tandoor.clients import CASSANDRA_DOWN, REDIS_DOWN
from tandoor.policies.api_keys import KeyStore, Principal
from tandoor.policies.redis_keys import (
    BATCH_LINE_TTL_S,
    batch_cancel_key,
    batch_line_key,
    done_key,
    lease_key,
)

log = logging.getLogger(__name__)
KEY_CACHE_S = 30.0  # a revoked key stops being honoured within this
KEY_TRUSTED_S = 60.0  # the key store's own delay (its Redis cache): unreadable, found good
KEY_CACHE_SIZE = 10_000
T = TypeVar("T")


class LineMarks:
    def __init__(self, redis: Any, stored: StoredCancels | None = None) -> None:
        self._redis = redis
        self._stored = stored  # cancels as stored: Redis may have restarted empty

    async def where(self, request_id: str) -> str | None:
        """Where the line was read ("partition:offset") when it was handled, if it was."""
        value = await self._redis.get(batch_line_key(request_id))
        return value.decode() if isinstance(value, bytes) else value

    async def mark(self, request_id: str, position: str, first_only: bool = False) -> None:
        """`first_only`: keep an earlier mark (a refused repeat of a custom_id must not
        take its name from the line that has it)."""
        key = batch_line_key(request_id)
        await self._redis.set(key, position, ex=BATCH_LINE_TTL_S, nx=first_only)

    async def run_by_a_worker(self, request_id: str) -> bool:
        """A worker took the line (its lease, or its done mark): one forwarded before a
        crash that lost its mark, which its worker answers."""
        return bool(await self._redis.exists(lease_key(request_id), done_key(request_id)))

    async def cancelled(self, owner: str, batch_id: str | None) -> bool:
        return (owner, batch_id) in await self.cancelled_batches([(owner, batch_id)])

    async def cancelled_batches(
        self, batches: Iterable[tuple[str, str | None]]
    ) -> set[tuple[str, str | None]]:
        """Which of these (owner, batch id) were cancelled, asked in one round trip: a
        sweep over 20,000 waiting batches asked one by one took seconds, every second."""
        named = [(owner, batch_id) for owner, batch_id in set(batches) if batch_id]
        if not named:
            return set()
        async with self._redis.pipeline(transaction=False) as pipe:
            for owner, batch_id in named:
                pipe.exists(batch_cancel_key(owner, batch_id))
            found = await pipe.execute()
        marked = {batch for batch, hit in zip(named, found, strict=True) if hit}
        unmarked = [batch for batch in named if batch not in marked]
        return marked | await self._marked_again(unmarked)

    async def _marked_again(self, batches: list[tuple[str, str]]) -> set[tuple[str, str]]:
        """Those of `batches` cancelled in the store, their Redis marks put back (the
        workers look at them too). The store unreachable: Redis's marks alone."""
        if self._stored is None or not batches:
            return set()
        try:
            cancelled = await self._stored.cancelled(batches)
        except CASSANDRA_DOWN as exc:
            log.warning("batch cancels as stored not read (%r): Redis's alone", exc)
            return set()
        if cancelled:
            log.warning("%d cancelled batches had no cancel in Redis: marked again", len(cancelled))
            async with self._redis.pipeline(transaction=False) as pipe:
                for owner, batch_id in cancelled:
                    pipe.set(batch_cancel_key(owner, batch_id), 1, ex=BATCH_LINE_TTL_S)
                await pipe.execute()
        return set(cancelled)


class CallerCache:
    """Keys resolved through the key store, kept KEY_CACHE_S (bad keys too)."""

    def __init__(self, keys: KeyStore) -> None:
        self._keys = keys
        self._callers: dict[str, tuple[float, Principal | None]] = {}
        self._revoked_owners: dict[str, tuple[float, str | None]] = {}

    async def resolve(self, key: str | None) -> Principal | None:
        if not key:
            return None
        return await _cached(self._callers, key, self._keys.resolve)

    async def resolve_again(self, key: str | None) -> Principal | None:
        """Looked up now, past this cache: a line about to run after waiting stops within
        the key store's own minute of a revocation, not that and KEY_CACHE_S more."""
        if not key:
            return None
        try:
            principal = await self._keys.resolve(key)
        except (*CASSANDRA_DOWN, *REDIS_DOWN):
            # Found good within the key store's minute: still good, as far as a revocation
            # is honoured anyway. Older, it is not taken on trust (a revoked key's lines
            # ran for as long as Cassandra was away): the line waits for the store.
            checked_at, cached = self._callers.get(key, (0.0, None))
            if cached is not None and time.monotonic() - checked_at <= KEY_TRUSTED_S:
                return cached
            raise
        self._callers[key] = (time.monotonic(), principal)
        return principal

    async def revoked_owner(self, key: str | None) -> str | None:
        """Whose key it was, if it was revoked: its lines are answered to that user."""
        if not key:
            return None
        return await _cached(self._revoked_owners, key, self._keys.revoked_owner)


async def _cached(
    cache: dict[str, tuple[float, T]], key: str, fetch: Callable[[str], Awaitable[T]]
) -> T:
    now = time.monotonic()
    cached = cache.get(key)
    if cached is None or now - cached[0] > KEY_CACHE_S:
        if len(cache) > KEY_CACHE_SIZE:
            cache.clear()
        cached = cache[key] = (now, await fetch(key))
    return cached[1]
