"""The rollup agents in faust's test context (no broker): what they count, publish,
forward and settle for each usage record."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import faust
import orjson
import pytest

from schemas.codec import decode, encode
from schemas.events import FinalEvent, UsageRecord, now_ms
from streams.app import create_app, rollup_tables
from streams.outputs import Outputs
from streams.rollups import Rollup
from tandoor.settings import Settings
from tests.unit.test_rollups import final_event


def usage(request_id: str, user: str = "ada", at: int = 125_000) -> UsageRecord:
    return UsageRecord(
        request_id=request_id,
        attempt=1,
        user_id=user,
        tier="plus",
        model="smollm2",
        prompt_tokens=3,
        completion_tokens=4,
        queue_ms=1,
        ttft_ms=10,
        duration_ms=100,
        finish_reason="stop",
        finished_at_ms=at,
    )


class Sink:
    def __init__(self) -> None:
        self.rollups: dict[str, dict[str, Any]] = {}
        self.forwarded: list[bytes] = []
        self.forwarded_payloads: list[bytes] = []
        self.settled: list[str] = []
        self.fail_forwards = 0  # the next forwards that fail (a crash before they got out)

    def outputs(self) -> Outputs:
        async def rollup(key: bytes, value: bytes) -> None:
            self.rollups[key.decode()] = orjson.loads(value)

        async def forward(key: bytes, value: bytes) -> None:
            if self.fail_forwards:
                self.fail_forwards -= 1
                raise RuntimeError("killed before the per-model copy got out")
            self.forwarded.append(key)
            self.forwarded_payloads.append(value)

        async def settle(record: UsageRecord) -> None:
            self.settled.append(record.request_id)

        return Outputs(rollups=rollup, by_model=forward, settle=settle)


@contextlib.contextmanager
def unit_app(**settings: Any) -> Iterator[tuple[faust.App, Sink]]:
    sink = Sink()
    app_id = f"unit-{uuid.uuid4().hex[:6]}"
    app = create_app(Settings(streams_app_id=app_id, **settings), sink.outputs())
    # Every partition quiet: the clock closes windows as soon as asked (test_streams_time
    # has the rule for a partition still reading).
    rollup_tables(app).quiet_s = 0.0
    yield app, sink
    # Iterating a stream made faust's consumer, whose thread has an event loop of its own
    # that never ran (no broker here); close it, or it leaks its sockets.
    consumer: Any = app.consumer
    consumer._thread.thread_loop.close()


@pytest.fixture
def app_and_sink() -> Iterator[tuple[faust.App, Sink]]:
    with unit_app() as made:
        yield made


async def test_the_user_agent_counts_forwards_and_settles(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    app, sink = app_and_sink
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("a")))
        await agent.put(encode(usage("b", at=130_000)))
        await agent.put(encode(usage("a")))  # a copy
    await count_per_model(app, sink)
    minute = sink.rollups["user/ada/1m/120000"]
    assert (minute["requests"], minute["prompt_tokens"], minute["completion_tokens"]) == (2, 6, 8)
    assert sink.rollups["user/ada/1h/0"]["requests"] == 2
    # The copy is passed on too (it is known there by its id); settling is idempotent.
    assert sink.forwarded == [b"smollm2"] * 3 and sink.settled == ["a", "b", "a"]
    assert sink.rollups["model/smollm2/1m/120000"]["requests"] == 2


async def test_titles_and_summaries_count_for_the_model_not_the_user(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    """The gateway's own jobs (charged no quota, not listed in the user's usage) are the
    model's work: a one-turn chat is one request of the user's, two of the model's."""
    app, sink = app_and_sink
    title = usage("t").model_copy(update={"kind": "title", "prompt_tokens": 300})
    summary = usage("s").model_copy(update={"kind": "summary"})
    async with app.agents["rollups-by-user"].test_context() as agent:
        for record in (usage("a"), title, summary):
            await agent.put(encode(record))
    await count_per_model(app, sink)
    mine = sink.rollups["user/ada/1m/120000"]
    assert (mine["requests"], mine["prompt_tokens"]) == (1, 3), mine
    assert sink.rollups["model/smollm2/1m/120000"]["requests"] == 3


async def count_per_model(app: faust.App, sink: Sink) -> None:
    """The per-model agent reads what the per-user one passed on; both publish."""
    async with app.agents["rollups-by-model"].test_context() as agent:
        for payload in sink.forwarded_payloads:
            await agent.put(payload)
    await rollup_tables(app).publish_changes()


async def test_a_record_whose_copy_per_model_was_cut_short_is_counted_per_model(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    """Killed after the id was marked and before the per-model copy got out: read again,
    the record was known by its id and not passed on, so no model rollup counted it."""
    app, sink = app_and_sink
    sink.fail_forwards = 1
    async with app.agents["rollups-by-user"].test_context() as agent:
        with contextlib.suppress(RuntimeError, TimeoutError):
            await asyncio.wait_for(agent.put(encode(usage("a"))), 2)
    assert sink.fail_forwards == 0, "the forward never failed: no crash was tested"
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("a")))  # read again after the restart
    await count_per_model(app, sink)
    assert sink.rollups["user/ada/1m/120000"]["requests"] == 1
    assert sink.rollups["model/smollm2/1m/120000"]["requests"] == 1


async def test_the_token_stream_yields_re_runs_only(app_and_sink: tuple[faust.App, Sink]) -> None:
    app, sink = app_and_sink
    async with app.agents["restarts-from-tokens"].test_context() as agent:
        for attempt in (1, 2):
            await agent.put(encode(final_event("a", attempt)))
    assert sink.forwarded == [b"smollm2"]  # only the re-run goes on to the model rollups
    # Without the reply: that topic is kept 30 days, `tokens` one (a reply asked not to
    # be stored, or whose conversation was deleted, stayed readable there a month).
    assert decode(FinalEvent, sink.forwarded_payloads[0]).text == ""
    async with app.agents["rollups-by-model"].test_context() as agent:
        await agent.put(encode(final_event("a", 2)))
        await agent.put(encode(final_event("a", 2)))  # a replay
    await rollup_tables(app).publish_changes()
    assert sink.rollups["model/smollm2/1m/0"]["restarts"] == 1


async def test_the_model_agent_counts_per_model(app_and_sink: tuple[faust.App, Sink]) -> None:
    app, sink = app_and_sink
    async with app.agents["rollups-by-model"].test_context() as agent:
        await agent.put(encode(usage("a", user="ada")))
        await agent.put(encode(usage("b", user="bob")))
        await agent.put(b"not an event")  # skipped, not fatal
    await rollup_tables(app).publish_changes()
    assert sink.rollups["model/smollm2/1m/120000"]["requests"] == 2
    assert "user/ada/1m/120000" not in sink.rollups


async def test_a_usage_record_forwarded_twice_counts_once_per_model(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    """kill -9 after the per-model copy went out but before the user table's changelog
    did: the record is counted per user again on replay and forwarded again, as a new
    record of the by-model topic (which deduped by offset only: two requests)."""
    app, sink = app_and_sink
    async with app.agents["rollups-by-model"].test_context() as agent:
        await agent.put(encode(usage("a")))
        await agent.put(encode(usage("a")))  # the copy forwarded again on replay
        await agent.put(encode(final_event("a", 2)))  # its re-run counts on its own
    await rollup_tables(app).publish_changes()
    minute = sink.rollups["model/smollm2/1m/120000"]
    assert minute["requests"] == 1, minute


async def test_a_record_whose_counting_was_cut_short_is_counted_when_read_again(
    app_and_sink: tuple[faust.App, Sink], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The id was marked counted before the rollups were changed: a crash in between
    (the id's changelog out, the rollups' not) left the record uncounted for good."""
    app, sink = app_and_sink
    real_add = Rollup.add

    crashed: list[str] = []

    def crash_once(rollup: Rollup, record: UsageRecord) -> None:
        monkeypatch.setattr(Rollup, "add", real_add)
        crashed.append(record.request_id)
        raise RuntimeError("killed mid-count")

    monkeypatch.setattr(Rollup, "add", crash_once)
    async with app.agents["rollups-by-user"].test_context() as agent:
        with contextlib.suppress(RuntimeError, TimeoutError):
            await asyncio.wait_for(agent.put(encode(usage("a"))), 2)
    assert crashed == ["a"], "the count never crashed: no crash was tested"
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("a")))  # read again after the restart
    await rollup_tables(app).publish_changes()
    assert sink.rollups["user/ada/1m/120000"]["requests"] == 1


@pytest.fixture
def short_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[faust.App, Sink]]:
    """An app keeping 2 windows of each size and 60 s of counted ids, tidying up after
    every record."""
    monkeypatch.setattr("streams.tables.HOUSEKEEP_EVERY_S", 0.0)
    with unit_app(streams_retention_windows=2, streams_dedupe_s=60) as made:
        yield made


async def test_old_windows_and_ids_expire_by_record_time(
    short_memory: tuple[faust.App, Sink], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, sink = short_memory
    tables = rollup_tables(app)
    hour = (now_ms() // 3_600_000 + 1) * 3_600_000
    # The clock stays at the last record: record time rules, not how long the test takes.
    monkeypatch.setattr("streams.tables.now_ms", lambda: hour + 599 * 2_000)
    async with app.agents["rollups-by-user"].test_context() as agent:
        for i in range(600):  # one record every 2 s for 20 minutes
            await agent.put(encode(usage(f"r{i}", at=hour + i * 2_000)))
            if i % 30 == 0:  # the publish timer (a window is dropped once published closed)
                await tables.publish_changes()
        sizes = tables.sizes()
        # 1m windows: the current one and 2 kept after it ends (3); 1h: the current one.
        assert sizes["rollups-by-user"] == 3 + 1, sizes
        assert sizes["counted-by-user"] <= 31, sizes  # 60 s of ids at one per 2 s
        await agent.put(encode(usage("r599", at=hour + 599 * 2_000)))  # a repeat
    await tables.publish_changes()
    this_hour = sink.rollups[f"user/ada/1h/{hour}"]
    assert this_hour["requests"] == 600 and not this_hour["closed"]
    minutes = [r for k, r in sink.rollups.items() if "/1m/" in k]
    assert len(minutes) == 20 and sum(r["closed"] for r in minutes) == 19, minutes
    assert all(r["requests"] == 30 for r in minutes), minutes


async def test_a_window_that_expires_during_a_catch_up_ends_with_its_whole_count(
    short_memory: tuple[faust.App, Sink],
) -> None:
    """Reading usage hours old (after an outage): the publish timer fires while a minute
    is half counted, and publishes it closed. Its last publication is its whole count,
    though stream time passes its expiry before the next tick."""
    app, sink = short_memory
    tables = rollup_tables(app)
    old = (now_ms() // 3_600_000 - 3) * 3_600_000
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("a0", at=old + 1_000)))
        await tables.publish_changes()  # the timer, mid-minute
        assert sink.rollups[f"user/ada/1m/{old}"]["closed"]
        for i in range(1, 10):
            await agent.put(encode(usage(f"a{i}", at=old + 1_000 + i)))
        for minute in range(1, 5):  # past its expiry (two windows kept)
            await agent.put(encode(usage(f"b{minute}", at=old + minute * 60_000 + 1)))
    await tables.publish_changes()
    last = sink.rollups[f"user/ada/1m/{old}"]
    assert (last["requests"], last["closed"]) == (10, True), last
    assert sink.rollups[f"user/ada/1m/{old + 60_000}"]["requests"] == 1, "expired unpublished"


async def test_a_copy_read_again_after_its_id_expired_is_still_not_counted(
    short_memory: tuple[faust.App, Sink], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy skipped by its id is in no rollup's offset; read again after a restart,
    once stream time has dropped its id, it must still be known (CI found this)."""
    app, sink = short_memory
    tables = rollup_tables(app)
    hour = (now_ms() // 3_600_000 + 1) * 3_600_000
    copy, later = usage("a", at=hour), usage("b", at=hour + 120_000)
    monkeypatch.setattr("streams.tables.now_ms", lambda: later.finished_at_ms)
    async with app.agents["rollups-by-user"].test_context() as agent:
        for record in (copy, copy, later):  # offsets 0, 1 (skipped by id), 2 (drops the id)
            await agent.put(encode(record))
        tables._books.clear()  # restarted: the books are rebuilt from the tables
        agent.sent_offset = 1  # and offsets 1 and 2 are read again
        for record in (copy, later):
            await agent.put(encode(record))
    summaries = {f"{s['window']}/{s['start_ms']}": s for s in tables.summaries("user", "ada") or []}
    assert summaries[f"1m/{hour}"]["requests"] == 1
    assert summaries[f"1h/{hour}"]["requests"] == 2
    await count_per_model(app, sink)
    assert sink.rollups[f"model/smollm2/1h/{hour}"]["requests"] == 2


async def test_changes_are_published_once_per_interval_not_per_record(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    app, _ = app_and_sink
    published: list[str] = []

    async def rollup(key: bytes, value: bytes) -> None:
        published.append(key.decode())

    tables = rollup_tables(app)
    tables._publish = rollup  # count publications
    async with app.agents["rollups-by-user"].test_context() as agent:
        for i in range(100):
            await agent.put(encode(usage(f"p{i}", at=now_ms())))
    assert published == []
    assert await tables.publish_changes() == 2  # the minute and the hour, once each
    assert await tables.publish_changes() == 0  # nothing changed since


async def test_a_record_counted_while_changes_are_published_is_published_next(
    app_and_sink: tuple[faust.App, Sink], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent counts on while a publication waits for Kafka: what it changed then
    was cleared with what had just been sent, and never published (a window already
    published as closed kept its count without the late record for good)."""
    app, sink = app_and_sink
    tables = rollup_tables(app)
    hour = (now_ms() // 3_600_000 + 1) * 3_600_000
    monkeypatch.setattr("streams.tables.now_ms", lambda: hour)  # nothing closes meanwhile
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("a", at=hour)))
        send = tables._publish

        async def publish_while_counting(key: bytes, value: bytes) -> None:
            tables._publish = send
            await send(key, value)
            await agent.put(encode(usage("b", at=hour + 1_000)))  # counted meanwhile

        tables._publish = publish_while_counting
        await tables.publish_changes()
        await tables.publish_changes()
    assert sink.rollups[f"user/ada/1h/{hour}"]["requests"] == 2
    assert sink.rollups[f"user/ada/1m/{hour}"]["requests"] == 2


async def test_the_rollups_read_over_http_say_which_windows_are_closed(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    app, _ = app_and_sink
    hours_ago = (now_ms() // 3_600_000 - 3) * 3_600_000
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("a", at=hours_ago)))
        await agent.put(encode(usage("b", at=now_ms())))
    closed = {
        (s["window"], s["start_ms"] == hours_ago): s["closed"]
        for s in rollup_tables(app).summaries("user", "ada") or []
    }
    assert closed == {
        ("1m", True): True,
        ("1h", True): True,
        ("1m", False): False,
        ("1h", False): False,
    }


async def test_the_rollups_read_over_http_are_the_named_users_only(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    app, _ = app_and_sink
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("a", user="alice")))
        await agent.put(encode(usage("b", user="alice/bob")))  # user ids may hold a "/"
    tables = rollup_tables(app)
    assert [s["key"] for s in tables.summaries("user", "alice") or []] == ["alice"] * 2
    assert [s["key"] for s in tables.summaries("user", "alice/bob") or []] == ["alice/bob"] * 2
