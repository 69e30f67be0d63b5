"""`tandoor streams`: a faust-streaming app that rolls `usage` up per user and per
model, in one-minute and one-hour tumbling windows (by the time each request
finished), and counts re-runs (a worker died mid-reply) from `tokens`.

- channels and the app: here;
- agents (what each record does): agents.py;
- tables (in memory, changelogged in Kafka, so a restarted app recovers them; a record
  replayed after a restart is recognised by its request id and not counted again; old
  windows and ids expire by time, so memory stays flat): tables.py, over the rollups of
  rollups.py;
- outputs: changes are published to `usage.rollups` at a bounded rate, and each window
  once more when it closes (keyed by rollup, the latest message per key is current);
  the same records settle the tokens-per-minute quota in Redis with the real usage,
  batch lines included: outputs.py;
- the web port: `GET /rollups/user/<user>` and `GET /rollups/model/<model>` with the
  analytics token, and /metrics, /health, /ready: web.py.
"""

from __future__ import annotations

import weakref

import faust
from aiokafka.admin import AIOKafkaAdminClient

from infra.topics import DAY_MS, TopicSpec, partition_counts
from schemas import topics
from schemas.topics import USAGE_PARTITIONS
from streams.agents import register_agents
from streams.outputs import Outputs, kafka_outputs
from streams.tables import RollupTables
from streams.web import install_pages
from tandoor.settings import Settings

TABLES: weakref.WeakKeyDictionary[faust.App, RollupTables] = weakref.WeakKeyDictionary()


def create_app(settings: Settings, outputs: Outputs | None = None) -> faust.App:
    app = faust_app(settings)
    usage = app.topic(settings.streams_usage_topic, key_type=bytes, value_type=bytes)
    tokens = app.topic(topics.TOKENS, key_type=bytes, value_type=bytes)
    by_model = app.topic(
        by_model_topic(settings).name,
        key_type=bytes,
        value_type=bytes,
        partitions=topics.USAGE_PARTITIONS,
        internal=True,
    )
    rollups_out = app.topic(topics.USAGE_ROLLUPS, key_type=bytes, value_type=bytes)
    out = outputs or kafka_outputs(settings, by_model, rollups_out)
    rollups = RollupTables(app, settings, out.rollups)
    register_agents(app, usage, tokens, by_model, rollups, out)

    @app.timer(settings.streams_publish_s)  # type: ignore[untyped-decorator]
    async def publish_rollups() -> None:
        await rollups.publish_changes()

    TABLES[app] = rollups

    install_pages(app, rollups, settings.analytics_token)
    return app


def rollup_tables(app: faust.App) -> RollupTables:
    """The tables an app made by create_app counts into."""
    return TABLES[app]


def by_model_topic(settings: Settings) -> TopicSpec:
    """The app's own topic of usage keyed by model. `tandoor streams` creates it before
    the app starts: faust creates it too, but a consumer that joined before Kafka's
    metadata had it ignored it ("Ignoring missing topic") until the next rebalance, and
    the per-model rollups stayed empty."""
    return TopicSpec(
        f"{settings.streams_app_id}-usage-by-model",
        topics.USAGE_PARTITIONS,
        {"retention.ms": str(30 * DAY_MS)},
        settings.kafka_replication_factor,
    )


async def partitions_refused(settings: Settings) -> str | None:
    """Why the app cannot count `usage` as its topics are, if it cannot: its tables are
    co-partitioned with `usage` (USAGE_PARTITIONS), and their changelogs keep the count
    they were made with. `usage` grown in place (as CAPACITY.md once advised) stopped
    every count (faust's PartitionsMismatch at each record), and a window's records and
    its changelog partition no longer matched."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    try:
        await admin.start()
        counts = await partition_counts(admin)
    finally:
        await admin.close()
    ours = [settings.streams_usage_topic] + [
        name
        for name in counts
        if name.startswith(f"{settings.streams_app_id}-") and name.endswith("-changelog")
    ]
    wrong = {
        name: counts[name]
        for name in ours
        if counts.get(name, USAGE_PARTITIONS) != USAGE_PARTITIONS
    }
    if not wrong:
        return None
    found = ", ".join(f"{name} has {n}" for name, n in sorted(wrong.items()))
    return (
        f"the rollups' tables are made for {USAGE_PARTITIONS} partitions of "
        f"{settings.streams_usage_topic}, but {found}: after changing the usage partitions, "
        "start the app under a new TANDOOR_STREAMS_APP_ID (new tables; docs/CAPACITY.md)"
    )


def faust_app(settings: Settings) -> faust.App:
    return faust.App(
        settings.streams_app_id,
        broker=f"kafka://{settings.kafka_bootstrap}",
        store="memory://",
        autodiscover=False,
        datadir=str(settings.home / "streams"),
        web_enabled=True,
        # Only the token-checked rollups and the ops pages: faust's own views of the
        # cluster and its tables answer anyone.
        web_router_enabled=False,
        web_tables_enabled=False,
        web_bind=settings.host,
        web_host=settings.host,
        web_port=settings.streams_web_port,
        topic_partitions=topics.USAGE_PARTITIONS,
        topic_replication_factor=settings.kafka_replication_factor,
        producer_acks=-1,
        key_serializer="raw",
        value_serializer="raw",
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=settings.streams_session_timeout_s,
    )
