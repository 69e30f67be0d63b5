"""The local stack: Kafka, Cassandra and Redis, started together and checked together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from infra import cql, topics
from infra.cassandra_server import CassandraServer
from infra.kafka_server import KafkaServer
from infra.redis_server import RedisServer
from infra.server import LocalServer, ServerStatus
from tandoor.clients import cassandra_session
from tandoor.settings import Settings

log = logging.getLogger(__name__)


class Stack:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.servers: Sequence[LocalServer] = (
            KafkaServer(settings),
            CassandraServer(settings),
            RedisServer(settings),
        )
        self.started: list[LocalServer] = []  # by up(), in order

    def up(self) -> None:
        """Start what is not running, then wait for all; the slow starts overlap."""
        for server in self.servers:
            log.info("%s: fetching", server.name)
            server.fetch()
        for server in self.servers:
            if server.launch():
                self.started.append(server)
                log.info("%s: starting on %s", server.name, server.address)
        for server in self.servers:
            server.wait_ready()
            log.info("%s: ready", server.name)

    def down(self, started_only: bool = False) -> None:
        """Stop the servers; with `started_only`, those this Stack's up() started (a run
        beside a stack someone brought up for other work leaves theirs running)."""
        servers = self.started if started_only else self.servers
        for server in reversed(servers):  # Kafka last: clients may still flush to it
            if server.stop():
                log.info("%s: stopped", server.name)

    def gone(self) -> str | None:
        """A server that has exited since up(), named with its log."""
        for server in self.servers:
            if server.process.pid() is None:
                return f"{server.name} exited; log {server.process.log_file}"
        return None

    def status(self) -> list[ServerStatus]:
        return [server.status() for server in self.servers]

    def healthy(self) -> bool:
        return all(status.ready for status in self.status())


@dataclass
class BootstrapReport:
    topics: topics.TopicReport
    migrations: list[str]

    def describe(self) -> str:
        t = self.topics
        return (
            f"topics created {t.created or '-'}, grown {t.grown or '-'}, "
            f"unchanged {len(t.unchanged)}; migrations applied {self.migrations or '-'}"
        )


async def bootstrap(settings: Settings) -> BootstrapReport:
    """Declare topics and apply CQL migrations; running it twice changes nothing."""
    topic_report = await topics.ensure_topics(
        settings.kafka_bootstrap, topics.declared_topics(settings)
    )
    migrations = await asyncio.to_thread(_migrate, settings)
    return BootstrapReport(topic_report, migrations)


def _migrate(settings: Settings) -> list[str]:
    with cassandra_session(settings) as session:
        return cql.migrate(session, settings.keyspace, settings.cassandra_replication_factor)
