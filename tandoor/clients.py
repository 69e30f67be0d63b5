"""Connections to the stores, configured from Settings in one place."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from aiokafka.structs import ConsumerRecord
from cassandra import ConsistencyLevel, OperationTimedOut, RequestExecutionException
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile, NoHostAvailable
from cassandra.policies import (
    DCAwareRoundRobinPolicy,
    ExponentialReconnectionPolicy,
    TokenAwarePolicy,
)
from cassandra.query import BatchStatement, BatchType
from redis._parsers.base import BaseParser as RedisReplyParser
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import ResponseError as RedisResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas import topics
from tandoor.redis_breaker import GuardedConnection, RedisBreaker
from tandoor.renewing_producer import RenewingProducer
from tandoor.settings import Settings

CASSANDRA_RECONNECT_MAX_S = 5.0
CASSANDRA_CONTROL_TIMEOUT_S = 15.0
REDIS_CONNECT_TIMEOUT_S = 2.0
# Redis answers in well under a millisecond; a call that has waited two seconds is on a
# server that took the connection but stopped answering (stopped, swapping, its host
# stalled). No call here blocks on the server side, so a read timeout is safe; but a
# call timed out may still run when the server wakes (docs/architecture.md).
REDIS_READ_TIMEOUT_S = 2.0
REDIS_RETRIES = 2
# Calls at once past this wait for a connection (up to the read timeout): redis-py's own
# pool refused the 101st at once, and that read as Redis down (free tiers refused,
# paid ones admitted uncounted) on a healthy but busy replica.
REDIS_MAX_CONNECTIONS = 128


def cassandra_cluster(settings: Settings) -> Cluster:
    policy = TokenAwarePolicy(DCAwareRoundRobinPolicy(local_dc=settings.cassandra_datacenter))
    return Cluster(
        [settings.host],
        port=settings.cassandra_port,
        protocol_version=5,
        connect_timeout=10,
        # The first connection reads the whole schema; on a loaded CI machine that took
        # longer than the driver's 2 s default and the connect failed (NoHostAvailable).
        control_connection_timeout=CASSANDRA_CONTROL_TIMEOUT_S,
        # After a Cassandra restart, be back within seconds: the driver's default
        # backoff grows to 10 minutes, leaving a role failing long after it is up.
        reconnection_policy=ExponentialReconnectionPolicy(0.5, CASSANDRA_RECONNECT_MAX_S),
        execution_profiles={
            EXEC_PROFILE_DEFAULT: ExecutionProfile(
                load_balancing_policy=policy,
                # Read what was just written at replication 3 (the deployed keyspaces):
                # the driver's LOCAL_ONE let a read miss a write one replica had taken.
                consistency_level=ConsistencyLevel.LOCAL_QUORUM,
            )
        },
    )


@contextmanager
def cassandra_session(settings: Settings, keyspace: str | None = None) -> Iterator[Any]:
    cluster = cassandra_cluster(settings)
    try:
        yield cluster.connect(keyspace)
    finally:
        cluster.shutdown()


# What a call to an unreachable or unanswering Redis raises (after redis_client's short
# retries), a replica answers while a failover promotes another, or a full one answers a
# write: in each the state Redis holds cannot be kept, so the same policy applies.


class RedisCannotPersist(RedisResponseError):
    """MISCONF: a Redis that saves snapshots refuses every write once one failed (a full
    disk), until one succeeds. redis-py raises a bare ResponseError for it, which
    callers cannot tell from a script's bug; registered here, it reads as Redis down."""


RedisReplyParser.EXCEPTION_CLASSES["MISCONF"] = RedisCannotPersist
REDIS_DOWN = (
    RedisConnectionError,
    RedisTimeoutError,
    RedisReadOnlyError,
    RedisOutOfMemoryError,
    RedisCannotPersist,
)
# Cassandra unreachable or overloaded (timeouts, too few replicas): worth a retry, unlike
# a statement it refuses.
CASSANDRA_DOWN = (NoHostAvailable, OperationTimedOut, RequestExecutionException)


def redis_client(settings: Settings) -> aioredis.Redis:
    """Retries ride out a blip (a failover takes about a second) but give up within
    half a second: the callers have a Redis-down policy (docs/architecture.md "When Redis is down"),
    and redis-py's default backoff added seconds to every request during an outage."""
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        connection_class=GuardedConnection,  # a Redis gone quiet: the next calls fail at once
        breaker=RedisBreaker(),
        max_connections=REDIS_MAX_CONNECTIONS,
        timeout=REDIS_READ_TIMEOUT_S,
        decode_responses=False,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        socket_timeout=REDIS_READ_TIMEOUT_S,
        # A timeout is not tried again: a server that let a second pass will not answer
        # the next try sooner, and each would add a second to every call of an outage.
        retry=Retry(
            ExponentialBackoff(cap=0.25, base=0.05),
            REDIS_RETRIES,
            supported_errors=(RedisConnectionError,),
        ),
    )
    return aioredis.Redis.from_pool(pool)


def kafka_producer(settings: Settings, client_id: str) -> RenewingProducer:
    """acks=all with idempotence: prompts and final events must not be lost or doubled,
    and one request's events stay in order, a Kafka that lost track of the producer's
    sequence included (renewing_producer.py). A short linger: never wait for a batch."""
    return RenewingProducer(
        lambda: AIOKafkaProducer(
            bootstrap_servers=settings.kafka_bootstrap,
            client_id=client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=settings.producer_linger_ms,
        )
    )


TRANSACTION_TIMEOUT_MS = 60_000  # a dead producer's transaction is aborted after it


def transactional_producer(settings: Settings, transactional_id: str) -> AIOKafkaProducer:
    """A producer for one transaction (its records are read all or none)."""
    return AIOKafkaProducer(
        transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
        bootstrap_servers=settings.kafka_bootstrap,
        client_id="batch-queue",
        transactional_id=transactional_id,
        acks="all",
        enable_idempotence=True,
        linger_ms=settings.producer_linger_ms,
    )


async def assign_from_end(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """Read every partition of `topic` from its current end, without a consumer group
    (every reader sees every event). The consumer must be started."""
    # A consumer without a subscription holds no metadata and topics() fills a separate
    # copy, so refresh the client's own (aiokafka has no public call for this).
    await consumer._client.force_metadata_update()
    partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        raise RuntimeError(f"topic {topic} does not exist: run `tandoor bootstrap`")
    assigned = [TopicPartition(topic, p) for p in sorted(partitions)]
    consumer.assign(assigned)
    await consumer.seek_to_end(*assigned)
    for tp in assigned:  # resolve positions now, so nothing produced after this is missed
        await consumer.position(tp)
    return assigned


async def cql(
    session: Any, statement: Any, params: Sequence[object] = (), large: bool = False
) -> list[Any]:
    """Run a statement and await all its rows (every page)."""
    pages = cql_pages(session, statement, params, large)
    return [row async for page in pages for row in page]


async def cql_pages(
    session: Any, statement: Any, params: Sequence[object] = (), large: bool = False
) -> AsyncIterator[list[Any]]:
    """A statement's rows page by page (the driver's fetch size), the next page fetched
    only once the caller has taken this one: a partition of any size is held a page at a
    time. Runs on the driver's threads, bridged to asyncio (the driver's own asyncio
    reactor is experimental).

    `large` values or rows (a file's chunks): timed out here, not by the driver, whose
    timer holds the request, its values and its rows, until the timeout's end whether
    answered or not (a file's 512 KiB chunks, 10 s of them, in memory)."""
    if not large:
        async for page in _pages(session, statement, params, driver_timed=True):
            yield page
        return
    timeout_s = session.default_timeout
    async with contextlib.aclosing(_pages(session, statement, params, False)) as pages:
        while True:
            try:
                async with asyncio.timeout(timeout_s):
                    page = await anext(pages)
            except StopAsyncIteration:
                return
            except TimeoutError as exc:
                raise OperationTimedOut(f"no answer in {timeout_s} s") from exc
            yield page


async def _pages(
    session: Any, statement: Any, params: Sequence[object], driver_timed: bool
) -> AsyncGenerator[list[Any]]:
    loop = asyncio.get_running_loop()
    pages: asyncio.Queue[tuple[list[Any], bool] | BaseException] = asyncio.Queue()

    def on_page(page: list[Any] | None) -> None:  # None for statements without rows
        got = (list(page or ()), bool(response.has_more_pages))
        loop.call_soon_threadsafe(pages.put_nowait, got)

    untimed = {} if driver_timed else {"timeout": None}
    response = session.execute_async(statement, params, **untimed)
    response.add_callbacks(on_page, lambda exc: loop.call_soon_threadsafe(pages.put_nowait, exc))
    try:
        while True:
            got = await pages.get()
            if isinstance(got, BaseException):
                raise got
            page, more = got
            yield page
            if not more:
                return
            response.start_fetching_next_page()
    finally:  # on_page and the response are a cycle, holding both until a collection
        response.clear_callbacks()


async def cql_together(session: Any, statements: Sequence[tuple[str, Sequence[object]]]) -> None:
    """Rows of different tables (different partitions) that mean nothing apart, in one
    logged batch: Cassandra applies all of them or, if the caller dies before it is sent,
    none; separate inserts left half a record when the caller died between them."""
    batch = BatchStatement(batch_type=BatchType.LOGGED)
    for statement, params in statements:
        batch.add(statement, params)
    await cql(session, batch)


async def send_dead_letter(
    producer: RenewingProducer, record: ConsumerRecord[bytes, bytes], reason: str
) -> None:
    """`record` on the dead-letter topic, with why and where it was read. A record near
    Kafka's size limit passes it once the headers are added, and would be refused on
    every retry: it goes without its value (its `source` header says where it is)."""
    where = (record.topic, record.partition, record.offset)
    try:
        headers = topics.dead_letter_headers(*where, reason)
        await producer.send_and_wait(
            topics.DEAD_LETTER, record.value, key=record.key, headers=headers
        )
    except MessageSizeTooLargeError:
        headers = topics.dead_letter_headers(*where, f"{reason} (value too large)")
        await producer.send_and_wait(topics.DEAD_LETTER, b"", key=record.key, headers=headers)


async def group_members(admin: AIOKafkaAdminClient, group: str) -> int:
    """Members of a consumer group (0 when it is empty or unknown to Kafka)."""
    for response in await admin.describe_consumer_groups([group]):
        for error_code, group_id, _state, _kind, _protocol, members, *_ in response.groups:
            if group_id != group:
                continue
            if error_code:
                raise KafkaError(f"describing group {group}: error code {error_code}")
            return len(members)
    return 0
