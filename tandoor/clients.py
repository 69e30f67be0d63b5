"""Connections to the stores, configured from Settings in one place."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
from cassandra.policies import DCAwareRoundRobinPolicy, TokenAwarePolicy

from tandoor.settings import Settings


@contextmanager
def cassandra_session(settings: Settings, keyspace: str | None = None) -> Iterator[Any]:
    policy = TokenAwarePolicy(DCAwareRoundRobinPolicy(local_dc=settings.cassandra_datacenter))
    cluster = Cluster(
        [settings.host],
        port=settings.cassandra_port,
        protocol_version=5,
        connect_timeout=10,
        execution_profiles={EXEC_PROFILE_DEFAULT: ExecutionProfile(load_balancing_policy=policy)},
    )
    try:
        yield cluster.connect(keyspace)
    finally:
        cluster.shutdown()


def redis_client(settings: Settings) -> aioredis.Redis:
    return aioredis.Redis.from_url(settings.redis_url, decode_responses=False)


def kafka_producer(settings: Settings, client_id: str) -> AIOKafkaProducer:
    """acks=all with idempotence: prompts and final events must not be lost or doubled,
    and one request's events stay in order. A short linger: never wait for a batch."""
    return AIOKafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap,
        client_id=client_id,
        acks="all",
        enable_idempotence=True,
        linger_ms=settings.producer_linger_ms,
    )
