"""The streams app against the real broker: rollups match numbers worked out by hand,
and a kill -9 and restart (with a replayed record) counts nothing twice."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiokafka import AIOKafkaConsumer
from prometheus_client.parser import text_string_to_metric_families

from infra.process import free_port
from infra.roles import StreamsProcess
from infra.topics import TopicSpec, ensure_topics
from schemas import topics
from schemas.codec import encode
from schemas.events import FinalEvent, FinishReason, Usage, UsageRecord, now_ms
from tandoor.clients import kafka_producer, redis_client
from tandoor.policies.quota import Quotas
from tandoor.policies.redis_keys import (
    quota_account,
    settled_key,
    streams_key,
    tokens_window_key,
)
from tandoor.settings import Settings, TierPolicy
from tests.waiting import eventually, while_progressing

pytestmark = pytest.mark.integration
HOUR_MS = 3_600_000
POLICY = TierPolicy(
    band="batch", requests_per_minute=9, tokens_per_minute=9_000, concurrent_streams=9
)


def record(
    user: str, model: str, at: int, prompt: int, completion: int, reason: FinishReason = "stop"
) -> UsageRecord:
    return UsageRecord(
        request_id=f"req-{uuid.uuid4().hex[:10]}",
        attempt=1,
        user_id=user,
        tier="plus",
        model=model,
        prompt_tokens=prompt,
        completion_tokens=completion,
        queue_ms=2,
        ttft_ms=40,
        duration_ms=40 + max(completion - 1, 0) * 50,  # after the first token, 20 tokens/s
        finish_reason=reason,
        finished_at_ms=at,
    )


def rerun_final(model: str, at: int) -> FinalEvent:
    return FinalEvent(
        request_id=f"req-{uuid.uuid4().hex[:10]}",
        attempt=2,
        seq=4,
        finish_reason="stop",
        text="again",
        usage=Usage(prompt_tokens=1, completion_tokens=1, queue_ms=0, decode_ms=0),
        model=model,
        user_id="someone",
        tier="plus",
        conversation_id="c",
        created_at_ms=at,
    )


async def publish(settings: Settings, *records: UsageRecord) -> None:
    async with kafka_producer(settings, "streams-test") as producer:
        for r in records:
            await producer.send_and_wait(topics.USAGE, encode(r), key=r.user_id.encode())


ANALYTICS_TOKEN = "analytics-" + uuid.uuid4().hex
ANALYTICS = {"Authorization": f"Bearer {ANALYTICS_TOKEN}"}


async def rollups(
    url: str, dimension: str, key: str, hour: int, expect: int
) -> dict[str, dict[str, Any]]:
    """`window/start -> summary` once the rollup of `hour` has counted `expect` requests."""
    async with httpx.AsyncClient(base_url=url, headers=ANALYTICS, timeout=10) as http:

        async def summaries() -> dict[str, dict[str, Any]]:
            response = await http.get(f"/rollups/{dimension}/{key}")
            if response.status_code != 200:
                return {}
            return {f"{s['window']}/{s['start_ms']}": s for s in response.json()["data"]}

        return await eventually(
            summaries,
            lambda found: found.get(f"1h/{hour}", {}).get("requests", 0) >= expect,
            what=f"{expect} requests in the {dimension} {key} rollup",
        )


async def published(settings: Settings, key_prefix: str) -> dict[str, dict[str, Any]]:
    """The latest `usage.rollups` message per key, for keys under `key_prefix`."""
    consumer = AIOKafkaConsumer(
        topics.USAGE_ROLLUPS,
        bootstrap_servers=settings.kafka_bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    latest: dict[str, dict[str, Any]] = {}
    try:
        while batch := await consumer.getmany(timeout_ms=2000):
            for records in batch.values():
                for r in records:
                    if r.key and r.key.decode().startswith(key_prefix) and r.value:
                        latest[r.key.decode()] = orjson.loads(r.value)
    finally:
        await consumer.stop()
    return latest


async def check_rollups_need_the_token(url: str, user: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        for headers in ({}, {"Authorization": "Bearer wrong-token-of-some-length"}):
            refused = await http.get(f"/rollups/user/{user}", headers=headers)
            assert refused.status_code == 401 and "error" in refused.json()


async def check_ops_pages(url: str) -> None:
    """Health, readiness and Prometheus metrics beside the rollups."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        assert (await client.get("/health")).json()["status"] == "ok"
        ready = await client.get("/ready")
        assert ready.status_code == 200 and all(ready.json()["checks"].values()), ready.text
        metrics = (await client.get("/metrics")).text
        for faust_view in ("/router/", "/table/"):  # the cluster and tables, to anyone
            assert (await client.get(faust_view)).status_code == 404, faust_view
    names = {
        sample.name
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
    }
    assert "tandoor_streams_messages_received_total" in names, sorted(names)[:20]


async def test_rollups_match_by_hand_and_survive_a_kill_9(
    settings: Settings, kafka: str, tmp_path: Path
) -> None:
    user, model = f"ada-{uuid.uuid4().hex[:6]}", f"m-{uuid.uuid4().hex[:6]}"
    hour = (now_ms() // HOUR_MS - 2) * HOUR_MS  # a closed hour: nothing else lands there
    first = [
        record(user, model, hour + 5_000, prompt=10, completion=20),
        record(user, model, hour + 20_000, prompt=7, completion=3, reason="cancelled"),
        record(user, model, hour + 59_999, prompt=5, completion=0, reason="error"),
    ]
    second = record(user, model, hour + 60_000, prompt=1, completion=2)
    # A request charged 500 tokens at admission that really used 60.
    cache = redis_client(settings)
    admitted = now_ms() + HOUR_MS  # a quota window that outlives the test
    used = record(user, model, now_ms(), prompt=40, completion=20)
    account = quota_account(user, used.tier)  # what the gateway charged (its key's tier)
    charge = await Quotas(cache).admit(account, POLICY, used.request_id, 500, admitted)
    used = used.model_copy(update={"charged_tokens": 500, "charged_at_ms": admitted})
    await publish(settings, *first, second, used, used)  # and a replay of it
    rerun = rerun_final(model, hour + 5_000)  # a worker died: the token stream shows attempt 2
    async with kafka_producer(settings, "streams-test") as producer:
        for _ in range(2):  # and a replay of that too
            await producer.send_and_wait(topics.TOKENS, encode(rerun), key=b"rerun")

    port = free_port()
    env = {
        "TANDOOR_STREAMS_APP_ID": f"streams-{uuid.uuid4().hex[:6]}",
        "TANDOOR_STREAMS_WEB_PORT": str(port),
        "TANDOOR_ANALYTICS_TOKEN": ANALYTICS_TOKEN,
        "TANDOOR_STREAMS_PUBLISH_S": "1",
        # Minute windows of two hours ago outlive the record of now (48 would not).
        "TANDOOR_STREAMS_RETENTION_WINDOWS": "300",
        # Ids are kept while stream time is within this of them: `used`, of now, moved
        # it two hours past the re-run, whose copy then counted again when read after it.
        "TANDOOR_STREAMS_DEDUPE_S": "86400",
        "TANDOOR_LOG_FORMAT": "json",
    }
    url = f"http://127.0.0.1:{port}"
    app = StreamsProcess(tmp_path, env)
    app.start()
    try:
        await app.wait_ready()
        # As every role logs (faust put its own text handler in place of ours).
        ready = [line for line in app.log().splitlines() if app.ready_line in line]
        assert json.loads(ready[0])["role"] == "streams", ready
        await check_rollups_need_the_token(url, user)
        for dimension, key in (("user", user), ("model", model)):
            got = await rollups(url, dimension, key, hour, expect=4)
            minute = got[f"1m/{hour}"]
            assert (minute["requests"], minute["prompt_tokens"], minute["completion_tokens"]) == (
                3,
                22,
                23,
            )
            assert (minute["errors"], minute["stops"]) == (1, 1)
            assert got[f"1m/{hour + 60_000}"]["requests"] == 1
            assert got[f"1h/{hour}"]["requests"] == 4
            assert got[f"1h/{hour}"]["ttft_ms"]["p50"] == pytest.approx(40, rel=0.25)
            assert got[f"1h/{hour}"]["decode_tokens_per_s"]["p50"] == pytest.approx(20, rel=0.25)
        got = await eventually(  # from `tokens`, by another agent
            lambda: rollups(url, "model", model, hour, expect=4),
            lambda found: found[f"1m/{hour}"]["restarts"],
            what="the restart counted",
        )
        assert got[f"1m/{hour}"]["restarts"] == 1 and got[f"1h/{hour}"]["restarts"] == 1
        tpm = tokens_window_key(account, charge.window_start_ms)

        async def charged() -> int:
            return int(await cache.get(tpm) or 0)

        # The charged record comes after the ones above.
        assert await eventually(charged, lambda n: n != 500, what="the settlement") == 60
        # Redis expires both keys a minute or two after the (pretend) charge time, in real
        # time: a slow restart below must not outlast them.
        for key in (tpm, settled_key(used.request_id)):
            assert await cache.pexpire(key, HOUR_MS), key
        # And its stream slot freed before that: nobody followed the reply to free it.
        assert await cache.zscore(streams_key(account), used.request_id) is None
        app.kill()

        # Replayed and new records while it is down: the replay must not count.
        later = record(user, model, hour + 61_000, prompt=4, completion=4)
        await publish(settings, first[0], later)
        app = StreamsProcess(tmp_path, env)
        app.start()
        await app.wait_ready()
        got = await rollups(url, "user", user, hour, expect=5)
        assert got[f"1h/{hour}"]["requests"] == 5
        assert got[f"1m/{hour}"]["requests"] == 3
        assert got[f"1m/{hour + 60_000}"]["requests"] == 2
        assert int(await cache.get(tpm) or 0) == 60, "settled once, replays or not"
        await check_ops_pages(url)
        # On `usage.rollups`, marked closed (hours ago) once the partition is quiet.
        latest = await eventually(
            lambda: published(settings, f"user/{user}/"),
            lambda found: found.get(f"user/{user}/1h/{hour}", {}).get("closed") is True,
            what="the hour's rollup published closed",
        )
        assert latest[f"user/{user}/1h/{hour}"]["requests"] == 5
        assert latest[f"user/{user}/1m/{hour}"]["prompt_tokens"] == 22
    finally:
        code = app.terminate()
        await cache.aclose()
    assert code == 0, "SIGTERM: a clean exit"


async def test_the_analytics_example_reads_the_streams(settings: Settings, kafka: str) -> None:
    user = f"bob-{uuid.uuid4().hex[:6]}"
    await publish(settings, record(user, "m", now_ms(), prompt=3, completion=4))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "consumers.tail",
        "usage",
        "--from-beginning",
        "--limit",
        "100000",
        # No --bootstrap: the stack's TANDOOR_HOST and TANDOOR_KAFKA_PORT, as documented
        # (it took 127.0.0.1:9092, another stack's broker or none).
        env={
            **os.environ,
            "TANDOOR_HOST": settings.host,
            "TANDOOR_KAFKA_PORT": str(settings.kafka_port),
        },
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    lines = [0]  # it reads `usage` from the start: waited for while it prints
    try:
        async with while_progressing(lambda: lines[0], "the example printing records"):
            while line := (await process.stdout.readline()).decode():
                lines[0] += 1
                if line.startswith(f"{user} m stop: 3+4 tokens"):
                    return
    finally:
        process.kill()
        await process.wait()
    raise AssertionError("the example never printed the record")


async def an_open_minute() -> tuple[int, int]:
    """Now, and its minute, open 20-60 s more (and 10 s of grace): long enough to see it
    published open and stop the app, the sooner the better (the test waits for it to
    close). Not the next minute: a record stamped ahead of the app's clock is counted
    at most 10 s ahead."""
    left_ms = 60_000 - now_ms() % 60_000
    if left_ms < 20_000:
        await asyncio.sleep(left_ms / 1000)  # the next one, from its start
    at = now_ms()
    return at, at - at % 60_000


async def test_a_window_open_at_a_restart_is_published_closed_with_no_record_after(
    settings: Settings, kafka: str, tmp_path: Path
) -> None:
    """Restarted, the app had no book for a partition until a record arrived on it, so a
    window still open at the restart was never published closed on a quiet partition."""
    user, model = f"quiet-{uuid.uuid4().hex[:6]}", f"m-{uuid.uuid4().hex[:6]}"
    env = {
        "TANDOOR_STREAMS_APP_ID": f"streams-{uuid.uuid4().hex[:6]}",
        "TANDOOR_STREAMS_WEB_PORT": str(free_port()),
        "TANDOOR_STREAMS_PUBLISH_S": "1",
    }
    app = StreamsProcess(tmp_path, env)
    app.start()
    try:
        await app.wait_ready()  # first: a slow start must not see the minute end
        at, minute = await an_open_minute()
        key = f"user/{user}/1m/{minute}"
        await publish(settings, record(user, model, at, prompt=3, completion=4))
        latest = await eventually(
            lambda: published(settings, f"user/{user}/"),
            lambda found: key in found,
            what="the open minute published",
        )
        assert latest[key]["requests"] == 1 and not latest[key]["closed"], latest[key]
        assert app.terminate() == 0  # its offsets committed: nothing is read again
        app = StreamsProcess(tmp_path, env)
        app.start()
        await app.wait_ready()
        latest = await eventually(  # 10 s after the minute ended
            lambda: published(settings, f"user/{user}/"),
            lambda found: found[key]["closed"],
            what="the minute published closed",
        )
        assert latest[key]["requests"] == 1
    finally:
        app.terminate()


async def streams_refused(env: dict[str, str]) -> tuple[int, str]:
    """`tandoor streams` with `env` on top of this one's: its exit code and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tandoor",
        "streams",
        env={**os.environ, **env},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
    assert process.returncode is not None
    return process.returncode, stderr.decode()


async def test_streams_refuse_usage_partitions_their_tables_were_not_made_for(
    settings: Settings, kafka: str
) -> None:
    """`usage` grown in place, as the capacity plan advised, left the tables' changelogs
    at their old count: faust refused every record (PartitionsMismatch), and the rollups
    stopped without a word at start. Now the app does not start, and says what to do."""
    app_id, grown = f"streams-{uuid.uuid4().hex[:6]}", f"usage-{uuid.uuid4().hex[:6]}"
    changelog = f"{app_id}-rollups-by-user-changelog"
    await ensure_topics(kafka, [TopicSpec(grown, 8), TopicSpec(changelog, 2)])
    code, said = await streams_refused(
        {"TANDOOR_STREAMS_APP_ID": app_id, "TANDOOR_STREAMS_USAGE_TOPIC": grown}
    )
    assert code == 2, said
    assert f"{grown} has 8" in said and f"{changelog} has 2" in said, said
    assert "TANDOOR_STREAMS_APP_ID" in said
