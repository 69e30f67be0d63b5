"""API keys against real Cassandra and Redis."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from schemas.events import MAX_ID_CHARS
from tandoor.clients import cassandra_session
from tandoor.policies.api_keys import KeyStore, Principal, key_hash
from tandoor.policies.redis_keys import api_key_cache_key
from tandoor.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
async def store(session: Any, redis_url: str) -> AsyncIterator[KeyStore]:
    cache = aioredis.Redis.from_url(redis_url)
    yield KeyStore(session, cache, {"free", "plus"})
    await cache.aclose()


async def test_a_created_key_resolves_to_its_user_and_tier(store: KeyStore) -> None:
    key, principal = await store.create("alice", "plus")
    assert key.startswith("tdr_") and len(key) > 40
    assert await store.resolve(key) == principal == Principal("alice", "plus", principal.key_id)
    assert await store.resolve(key) == principal  # second time from the Redis cache


async def test_keys_are_stored_hashed(store: KeyStore, session: Any) -> None:
    key, _ = await store.create("alice", "free")
    rows = [tuple(str(v) for v in row) for row in session.execute("SELECT * FROM api_keys")]
    assert rows and not any(key in value for row in rows for value in row)
    assert any(key_hash(key) in row for row in rows)


async def test_unknown_and_revoked_keys_do_not_resolve(store: KeyStore) -> None:
    assert await store.resolve("tdr_not-a-key") is None
    key, _ = await store.create("bob", "free")
    assert await store.resolve(key) is not None
    await store.revoke(key)
    assert await store.resolve(key) is None


async def test_a_malformed_key_is_refused_without_a_lookup(store: KeyStore, redis_url: str) -> None:
    key, _ = await store.create("erin", "free")
    malformed = ["tdr_short", key + "x", key[:-1] + "!", "x" * 5000, key.upper()]
    unknown = "tdr_" + "A" * 43
    cache = aioredis.Redis.from_url(redis_url)
    try:
        for bad in [*malformed, unknown]:
            assert await store.resolve(bad) is None
        cached = [await cache.exists(api_key_cache_key(key_hash(k))) for k in malformed]
        assert cached == [0] * len(malformed)
        assert await cache.exists(api_key_cache_key(key_hash(unknown)))  # well-shaped: looked up
    finally:
        await cache.aclose()


async def test_unknown_tier_and_empty_or_overlong_users_are_refused(store: KeyStore) -> None:
    with pytest.raises(ValueError, match="unknown tier 'gold'"):
        await store.create("carol", "gold")
    with pytest.raises(ValueError, match="user"):
        await store.create(" ", "free")
    # Its every prompt would be charged, then refused by the workers (ids key replies).
    with pytest.raises(ValueError, match=f"user.*{MAX_ID_CHARS}"):
        await store.create("u" * (MAX_ID_CHARS + 1), "free")
    await store.create("u" * MAX_ID_CHARS, "free")


async def test_a_key_whose_tier_is_no_longer_configured_is_refused(
    store: KeyStore, session: Any, redis_url: str
) -> None:
    """A tier dropped from the settings: its keys were a KeyError in every role that
    read the tier's limits (the gateway's 500, admission stopped on each restart)."""
    key, _ = await store.create("frank", "plus")
    assert await store.resolve(key) is not None  # cached with its tier
    cache = aioredis.Redis.from_url(redis_url)
    try:
        without_plus = KeyStore(session, cache, {"free"})
        assert await without_plus.resolve(key) is None  # from the cache
        await cache.delete(api_key_cache_key(key_hash(key)))
        assert await without_plus.resolve(key) is None  # from Cassandra
    finally:
        await cache.aclose()


async def test_cli_prints_the_key_as_its_last_line(
    cassandra: Settings, redis_url: str, settings: Settings
) -> None:
    argv = ["tandoor", "keys", "create", "--user", "dave", "--tier", "api"]
    result = await asyncio.to_thread(
        subprocess.run, argv, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip().splitlines()[-1]
    with cassandra_session(settings, settings.keyspace) as session:
        cache = aioredis.Redis.from_url(redis_url)
        try:
            principal = await KeyStore(session, cache, set(settings.tiers)).resolve(key)
        finally:
            await cache.aclose()
    assert principal is not None and (principal.user_id, principal.tier) == ("dave", "api")


def tandoor_keys(*args: str) -> subprocess.CompletedProcess[str]:
    argv = ["tandoor", "keys", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


async def test_an_operator_revokes_a_key_by_its_id_or_all_of_a_users_keys(
    cassandra: Settings, redis_url: str, settings: Settings
) -> None:
    """Revocation needed the key itself, which an operator who saw only its id (printed
    at creation, and in logs) or its user does not have: a leaked key stayed valid."""
    user, other = f"frank_{uuid.uuid4().hex[:8]}", f"gina_{uuid.uuid4().hex[:8]}"
    with cassandra_session(settings, settings.keyspace) as session:
        cache = aioredis.Redis.from_url(redis_url)
        store = KeyStore(session, cache, set(settings.tiers))
        try:
            (leaked, leaked_as), (kept, kept_as) = [
                await store.create(user, "plus") for _ in range(2)
            ]
            untouched, _ = await store.create(other, "plus")
            assert await store.resolve(leaked) is not None  # cached now

            result = await asyncio.to_thread(tandoor_keys, "revoke", "--key-id", leaked_as.key_id)
            assert result.returncode == 0, result.stderr
            assert leaked_as.key_id in result.stdout
            assert await store.resolve(leaked) is None, "refused at once, cache or not"
            assert await store.resolve(kept) is not None

            result = await asyncio.to_thread(tandoor_keys, "revoke", "--user", user)
            assert result.returncode == 0, result.stderr
            assert f"revoked 1 key(s): {kept_as.key_id}" in result.stdout, "the other one"
            assert f"already revoked: {leaked_as.key_id}" in result.stdout
            assert [await store.resolve(k) for k in (leaked, kept)] == [None, None]
            assert await store.resolve(untouched) is not None, "another user's key"
        finally:
            await cache.aclose()
    unknown = await asyncio.to_thread(tandoor_keys, "revoke", "--key-id", "nosuchkeyid")
    assert unknown.returncode == 1 and "no key with key id 'nosuchkeyid'" in unknown.stderr
    both = await asyncio.to_thread(tandoor_keys, "revoke", "--key-id", "x", "--user", "y")
    assert both.returncode == 2 and "one of them" in both.stderr
