"""API keys: created once, stored hashed, resolved to a user and a tier."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import logging
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from schemas.events import MAX_ID_CHARS
from tandoor.clients import REDIS_DOWN, cassandra_session, cql, redis_client
from tandoor.policies.redis_keys import api_key_cache_key, quota_account
from tandoor.settings import Settings

log = logging.getLogger(__name__)

KEY_PREFIX = "tdr_"
# What new_key makes: 32 random bytes, URL-safe base64 without padding.
KEY_SHAPE = re.compile(r"tdr_[A-Za-z0-9_-]{43}")
CACHE_TTL_S = 60  # a revoked key stops working within a minute


@dataclass(frozen=True)
class Principal:
    """Who is calling: what every route checks ownership and quotas against."""

    user_id: str
    tier: str
    key_id: str

    @property
    def quota_account(self) -> str:
        return quota_account(self.user_id, self.tier)


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, session: Any, cache: aioredis.Redis, tiers: set[str]) -> None:
        self._session = session
        self._cache = cache
        self._tiers = tiers

    async def create(self, user_id: str, tier: str) -> tuple[str, Principal]:
        """A new key for `user_id`; the key is returned once and stored only as a hash."""
        if tier not in self._tiers:
            raise ValueError(f"unknown tier {tier!r}; tiers are {sorted(self._tiers)}")
        if not user_id.strip():
            raise ValueError("user must not be empty")
        if len(user_id) > MAX_ID_CHARS:  # ids key every reply: workers refuse longer ones
            raise ValueError(f"user must be at most {MAX_ID_CHARS} characters")
        key = new_key()
        principal = Principal(user_id=user_id, tier=tier, key_id=key_hash(key)[:12])
        await cql(
            self._session,
            "INSERT INTO api_keys (key_hash, key_id, user_id, tier, created_at, revoked) "
            "VALUES (%s, %s, %s, %s, %s, false)",
            (key_hash(key), principal.key_id, user_id, tier, dt.datetime.now(dt.UTC)),
        )
        return key, principal

    async def resolve(self, key: str) -> Principal | None:
        """The principal of a valid key, or None; looked up in Redis before Cassandra.
        Something not shaped like a key is refused without either: no lookups and no
        cache entries for garbage."""
        if KEY_SHAPE.fullmatch(key) is None:
            return None
        principal = await self._resolve(key_hash(key))
        if principal is not None and principal.tier not in self._tiers:
            # A tier dropped from the settings: refused, not a KeyError in every role.
            log.error(
                "key %s has tier %r, which is not configured", principal.key_id, principal.tier
            )
            return None
        return principal

    async def _resolve(self, digest: str) -> Principal | None:
        try:
            cached = await self._cache.get(api_key_cache_key(digest))
        except REDIS_DOWN as exc:  # Cassandra holds every key: slower, still right
            log.warning("key cache unreachable (%s); reading the key from Cassandra", exc)
            return await self._lookup(digest)
        if cached is not None:
            data = orjson.loads(cached)
            return Principal(**data) if data else None
        principal = await self._lookup(digest)
        payload = orjson.dumps(principal.__dict__ if principal else {})
        with contextlib.suppress(*REDIS_DOWN):
            await self._cache.set(api_key_cache_key(digest), payload, ex=CACHE_TTL_S)
        return principal

    async def revoke(self, key: str) -> None:
        digest = key_hash(key)
        await cql(
            self._session, "UPDATE api_keys SET revoked = true WHERE key_hash = %s", (digest,)
        )
        await self._cache.delete(api_key_cache_key(digest))

    async def revoke_where(
        self, key_id: str | None = None, user_id: str | None = None
    ) -> tuple[list[str], list[str]]:
        """Revoke the key with this id, or every key of this user (what an operator knows:
        the id printed at creation, or the user); the ids revoked now, and those revoked
        before (both empty: none matched)."""
        column, value = ("key_id", key_id) if key_id is not None else ("user_id", user_id)
        rows = await cql(
            self._session,
            f"SELECT key_hash, key_id, revoked FROM api_keys WHERE {column} = %s",
            (value,),
        )
        for row in rows:
            await cql(
                self._session,
                "UPDATE api_keys SET revoked = true WHERE key_hash = %s",
                (row.key_hash,),
            )
            with contextlib.suppress(*REDIS_DOWN):  # cached for at most CACHE_TTL_S more
                await self._cache.delete(api_key_cache_key(row.key_hash))
        now = sorted(row.key_id for row in rows if not row.revoked)
        return now, sorted(row.key_id for row in rows if row.revoked)

    async def revoked_owner(self, key: str) -> str | None:
        """The user of a key that was made here and since revoked, else None: a batch
        line sent with it is still that user's to see refused (an API batch counts its
        lines' answers, and waited its whole window for one never written)."""
        if KEY_SHAPE.fullmatch(key) is None:
            return None
        row = await self._row(key_hash(key))
        return row.user_id if row is not None and row.revoked else None

    async def _lookup(self, digest: str) -> Principal | None:
        row = await self._row(digest)
        if row is None or row.revoked:
            return None
        return Principal(user_id=row.user_id, tier=row.tier, key_id=row.key_id)

    async def _row(self, digest: str) -> Any:
        rows = await cql(
            self._session,
            "SELECT key_id, user_id, tier, revoked FROM api_keys WHERE key_hash = %s",
            (digest,),
        )
        return rows[0] if rows else None


async def create_key(settings: Settings, user_id: str, tier: str) -> tuple[str, Principal]:
    """One-shot key creation with its own connections (the CLI's)."""
    async with _one_shot(settings) as store:
        return await store.create(user_id, tier)


async def revoke_key(settings: Settings, key: str) -> None:
    async with _one_shot(settings) as store:
        await store.revoke(key)


async def revoke_keys(
    settings: Settings, key_id: str | None = None, user_id: str | None = None
) -> tuple[list[str], list[str]]:
    """One-shot revocation by key id or user (the CLI's)."""
    async with _one_shot(settings) as store:
        return await store.revoke_where(key_id, user_id)


async def resolve_key(settings: Settings, key: str) -> Principal | None:
    """Who a key acts for, with its own connections (the CLI's)."""
    async with _one_shot(settings) as store:
        return await store.resolve(key)


@asynccontextmanager
async def _one_shot(settings: Settings) -> AsyncIterator[KeyStore]:
    cache = redis_client(settings)
    try:
        with cassandra_session(settings, settings.keyspace) as session:
            yield KeyStore(session, cache, set(settings.tiers))
    finally:
        await cache.aclose()
